"""Sequence parallelism in one process: how a batch is cut and what is kept for the loss, the settings and their
refusals, the helpers outside a group, a Hugging Face model wired and given back, and the planner's trace of one rank
(the Trainer runs on 2 and 4 ranks are in ``tests/distributed/test_sequence_parallel.py``)."""

import collections

import pytest
import torch
import torch.nn.functional as F

from lightning_zero import ZeroConfigError, ZeroStrategy
from lightning_zero.demo.gpt import Block, GPTLightningModule
from lightning_zero.planning import trace_step
from lightning_zero.sequence_parallel import SequenceParallel, group_mean, local_slice, positions, sequence_length
from lightning_zero.sequence_parallel.attention import HF_ATTENTION, AttentionInterception
from lightning_zero.sequence_parallel.batch import split_batch
from lightning_zero.sequence_parallel.causal_lm import SequenceParallelWiring
from lightning_zero.sequence_parallel.parallel import activate
from tests.distributed import hf_models


def test_a_dict_batch_is_cut_along_its_sequence_and_the_labels_shifted_over_the_whole():
    ids = torch.arange(2 * 8).reshape(2, 8)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 8), "sample": torch.tensor([4, 7])}
    cuts = [split_batch(batch, 2, rank) for rank in (0, 1)]
    for rank, (cut, shard) in enumerate(cuts):
        assert torch.equal(cut["input_ids"], ids[:, 4 * rank : 4 * rank + 4])
        assert torch.equal(cut["labels"], labels[:, 4 * rank : 4 * rank + 4])
        assert cut["attention_mask"].shape == (2, 4) and torch.equal(cut["sample"], batch["sample"])
        assert (shard.length, shard.local_length, shard.offset) == (8, 4, 4 * rank)
    # the next token at rank 0's last position is rank 1's first; the sequence's last has none
    shifted = torch.cat([torch.cat([cut["labels"] for cut, _ in cuts], 1)[:, 1:], torch.full((2, 1), -100)], 1)
    for rank, (cut, shard) in enumerate(cuts):
        tokens = shard.labels_for(cut["labels"])
        assert tokens is not None and tokens.local is cut["labels"]
        assert torch.equal(tokens.shifted, shifted[:, 4 * rank : 4 * rank + 4])
        # over both ranks: 2 x 7 next tokens, less the 2 the masked prompt holds after the shift
        assert tokens.valid.item() == 2 * 7 - 2
        # `labels=input_ids` (the model shifts them) finds the input ids' own next tokens
        assert shard.labels_for(cut["input_ids"]).valid.item() == 2 * 7
    # a copy is not told by its values: they may equal the labels on one rank and not on another
    assert cuts[1][1].labels_for(cuts[1][0]["input_ids"].clone()) is None


def test_tuples_named_tuples_and_a_lone_tensor_are_cut_too():
    ids = torch.arange(12).reshape(1, 12)
    pair, _ = split_batch((ids, ids + 1), 3, 2)
    assert isinstance(pair, tuple) and torch.equal(pair[1], ids[:, 8:] + 1)
    Sample = collections.namedtuple("Sample", "tokens targets")
    named, _ = split_batch(Sample(ids, ids), 2, 1)
    assert isinstance(named, Sample) and torch.equal(named.targets, ids[:, 6:])
    alone, shard = split_batch(ids, 4, 3)
    assert torch.equal(alone, ids[:, 9:]) and shard.offset == 9


@pytest.mark.parametrize(
    ("batch", "needle"),
    [
        ({"input_ids": torch.zeros(2, 9, dtype=torch.long)}, "9 positions, which do not divide into 2"),
        (
            {
                "input_ids": torch.zeros(2, 8, dtype=torch.long),
                "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2]),
            },
            "has zeros (padding)",
        ),
        (
            {
                "input_ids": torch.zeros(1, 8, dtype=torch.long),
                "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
            },
            "packed",
        ),
        ({"text": ["a sentence"]}, "a dict with `input_ids`"),
        (torch.zeros(8, dtype=torch.long), "one (batch, positions) tensor"),
    ],
)
def test_batches_that_cannot_be_cut_are_refused_by_name(batch, needle):
    with pytest.raises(ZeroConfigError, match="sequence_parallel_size=2") as error:
        split_batch(batch, 2, 0)
    assert needle in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sequence_parallel_size": 0}, "must be an integer >= 1"),
        ({"sequence_parallel_size": True}, "must be an integer >= 1"),
        ({"sequence_parallel_size": 2, "pipeline_stages": 2}, "`pipeline_stages=2`"),
        ({"sequence_parallel_size": 2, "shard_size": 2}, "`shard_size=2`"),
        ({"sequence_parallel_size": 2, "compile": True}, "`compile=True`"),
    ],
)
def test_settings_it_cannot_run_with_are_refused_at_construction(kwargs, needle):
    with pytest.raises(ZeroConfigError, match="sequence_parallel_size") as error:
        ZeroStrategy(**kwargs)
    assert needle in str(error.value)


def test_deepspeeds_sequence_parallel_size_maps_onto_it():
    config = {"zero_optimization": {"stage": 3}, "sequence_parallel_size": 4}
    assert ZeroStrategy(config=config).zero_config.sequence_parallel_size == 4
    with pytest.raises(ZeroConfigError, match="sequence_parallel_size"):
        ZeroStrategy(config={"zero_optimization": {"stage": 2}, "sequence_parallel_size": "two"})


def test_the_sampler_counts_data_parallel_replicas():
    """Lightning's sampler (and a user's own ``DistributedSampler``) read these: a group's ranks get the same
    samples."""
    devices = [torch.device("cpu")] * 4
    strategy = ZeroStrategy(sequence_parallel_size=2, parallel_devices=devices)
    strategy.set_world_ranks()
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert ZeroStrategy(parallel_devices=devices).distributed_sampler_kwargs["num_replicas"] == 4


def test_outside_sequence_parallelism_the_helpers_change_nothing():
    """A module may call them always: a plain run gets ``arange`` positions, its own tensors and a plain mean."""
    activate(None)
    assert torch.equal(positions(5), torch.arange(5)) and sequence_length(5) == 5
    x = torch.randn(2, 6)
    assert local_slice(x) is x
    assert group_mean(torch.tensor(6.0), 3).item() == 2.0


def test_a_helper_asked_outside_a_cut_batch_or_with_the_wrong_length_says_so():
    sequence = SequenceParallel(2, 0, 2, None)
    activate(sequence)
    try:
        with pytest.raises(ZeroConfigError, match="before the strategy cut a batch"):
            positions(4)
        sequence.split((torch.zeros(1, 8, dtype=torch.long),))
        assert torch.equal(positions(4), torch.arange(4)) and sequence.positions_given and sequence_length(4) == 8
        with pytest.raises(ZeroConfigError, match=r"positions\(8\): this rank holds 4 of the batch's 8"):
            positions(8)
        with pytest.raises(ZeroConfigError, match="6 positions along dim 1, not the batch's 8"):
            local_slice(torch.zeros(1, 6))
    finally:
        activate(None)


def test_attention_given_a_mask_or_heads_a_group_cannot_split_is_refused():
    sequence = SequenceParallel(2, 0, 2, None)
    q = torch.randn(1, 4, 8, 2)
    with AttentionInterception(sequence):
        with pytest.raises(ZeroConfigError, match="was given an `attn_mask`"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
        with pytest.raises(ZeroConfigError, match="has 3 heads"):
            F.scaled_dot_product_attention(*(torch.randn(1, 3, 8, 2) for _ in range(3)), is_causal=True)
        kv = torch.randn(1, 3, 8, 2)  # 3 key/value heads for 6 query heads: neither divides 2 nor 2 divides it
        with pytest.raises(ZeroConfigError, match="3 key/value heads"):
            F.scaled_dot_product_attention(torch.randn(1, 6, 8, 2), kv, kv, enable_gqa=True)


def test_a_hugging_face_causal_lm_is_wired_on_the_instance_and_given_back():
    """Wired, the model is still itself outside the strategy's steps (a callback may run it on one rank): its own
    attention and mask, the same logits, padding honoured."""
    model = hf_models.model_class("llama")(hf_models.tiny_config("llama"))
    ids = torch.randint(0, hf_models.VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    before = model.config._attn_implementation
    with torch.no_grad():
        plain = [model(input_ids=ids).logits, model(input_ids=ids, attention_mask=mask).logits]
    wiring = SequenceParallelWiring(torch.nn.ModuleDict({"lm": model}), 2)
    assert [w.model for w in wiring.models] == [model]  # not its inner LlamaModel, which shares the config
    assert model.config._attn_implementation == HF_ATTENTION
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain[0])
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, plain[1])
    wiring.undo()
    assert model.config._attn_implementation == before
    assert not model._forward_pre_hooks and not model._forward_hooks
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ZeroConfigError, match="BloomForCausalLM's attention does not go through transformers'"):
        SequenceParallelWiring(bloom, 2)
    from transformers import Lfm2Config, Lfm2ForCausalLM

    convolutions = Lfm2Config(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=32,
        layer_types=["conv", "full_attention"],
    )
    with pytest.raises(ZeroConfigError, match="Lfm2ForCausalLM uses layers of kind 'conv'"):
        SequenceParallelWiring(Lfm2ForCausalLM(convolutions), 2)
    sliding = hf_models.tiny_config("mixtral")
    sliding.sliding_window = 4
    with pytest.raises(ZeroConfigError, match="MixtralForCausalLM uses sliding-window attention"):
        SequenceParallelWiring(hf_models.model_class("mixtral")(sliding), 2)


def test_the_planner_traces_one_ranks_part_of_each_sequence():
    """The demo GPT and a Hugging Face Llama at 256 positions, traced as rank 0 of a group of 2: the activations are
    about half (attention exchanges heads for positions, so it holds the same bytes), and the step the trace ran was
    the sequence-parallel one (the GPT asked for its positions)."""
    from tests.distributed.worker_long_context import CausalLM

    x = torch.randint(0, 34, (2, 256))
    gpt = lambda: GPTLightningModule(vocab_size=34, block_size=256, n_layer=2, n_head=2, n_embd=32)  # noqa: E731
    llama = lambda: CausalLM("llama", max_position_embeddings=256)  # noqa: E731
    halves = {}
    for build in (gpt, llama):
        whole, halves[build] = (trace_step(build, (x, x), sequence_parallel_size=k) for k in (1, 2))
        assert halves[build].sequence_parallel_size == 2
        ratio = halves[build].activation_peak / whole.activation_peak
        assert 0.4 < ratio < 0.6, (whole.activation_peak, halves[build].activation_peak)
    checkpointed = trace_step(gpt, (x, x), activation_checkpointing=Block, sequence_parallel_size=2)
    assert checkpointed.activation_peak < halves[gpt].activation_peak
