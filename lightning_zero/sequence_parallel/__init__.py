"""Ulysses sequence parallelism: ``ZeroStrategy(sequence_parallel_size=k)``.

[Note: Ulysses sequence parallelism]
The ranks form groups of ``k`` consecutive ranks that share each sample; ZeRO shards over all of them, so the
data-parallel degree is ``world_size / k`` (``trainer.distributed_sampler_kwargs`` counts those replicas, so a
group's ranks read the same samples). The strategy cuts each batch along its sequence in ``batch_to_device``
(``batch.py``): every rank keeps ``T / k`` consecutive positions. Everything outside attention works on positions
independently; attention exchanges heads for positions with an all-to-all, attends over the whole sequence with
``H / k`` heads, and exchanges back (``attention.py``, ``exchange.py``).

Gradients: every rank's loss counts its own positions; the group's ranks' gradients together are the gradient of
the sample's loss, and ZeRO's average over all ``world_size`` ranks makes that the data-parallel mean when each
rank's loss is the same fraction of its group's (the mean over equally many positions, as the demo GPT's loss; or
:func:`group_mean`, or the group-summed loss a Hugging Face causal LM returns here, ``causal_lm.py``).

Positions: a Hugging Face causal LM is handed its global ``position_ids``; any other module asks :func:`positions`
(and :func:`sequence_length` for the whole length), and one that never does is stopped after its first training
step with an error naming the helper, rather than training on positions ``0 .. T/k - 1`` on every rank.

Sequence parallelism is *active* (:func:`active`) only while the strategy runs a step's forward or its backward; the
wired models and the helpers are plain outside, so a callback may run a model on one rank.
"""

from lightning_zero.sequence_parallel.parallel import (
    SequenceParallel,
    active,
    group_mean,
    local_slice,
    positions,
    sequence_length,
)

__all__ = ["SequenceParallel", "active", "group_mean", "local_slice", "positions", "sequence_length"]
