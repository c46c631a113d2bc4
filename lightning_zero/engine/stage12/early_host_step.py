"""The offloaded host step during backward (stages 1-2): each part of the step starts in a worker thread as soon as
its gradients are final on the host, while backward goes on.

[Note: the host step during backward]
With the optimizer offloaded, the host step is the longest piece of a step on a GPU (the host AdamW step of a 1.34B
GPT takes longer than its forward and backward together), and it used to start only when ``optimizer.step()`` was
called. Backward reduces the gradients a bucket at a time, last layers first, and each bucket's shards are copied to
the host as its reduction lands (see [Note: the offloaded step] in ``offload.py``); once every bucket of a part of
the step (``ShardedOptimizer.parts``) has landed, nothing but the step's coefficient and the used-parameter flags
stands between those gradients and the step. Where both are known before backward ends, the part's step starts at
once in a worker thread, so the host steps the last layers while the device still computes the gradients of the
first. It is used in a synchronising backward where, besides ``overlap_comm`` (the default):

* the step's coefficient is the averaging alone: no clipping (``gradient_clip_val`` unset and
  ``configure_gradient_clipping`` not overridden) and no loss scaler (``16-mixed`` can skip a step on overflow);
* there is one backward a step (automatic optimization; a second backward into a part already stepped is refused
  by the reducer, loudly), no delayed update, no hybrid replicas (their sums are added when the gradients are
  finalized), every master on the host and an element-wise torch optimizer without step hooks
  (``optimizers.steps_in_parts``);
* every parameter of the part produced a gradient on this rank: whether a parameter that did not was used on some
  other rank is known only when backward ends (``GradientReducer._forget_gradients_no_rank_produced``), so such a
  part waits for ``optimizer.step()``, as every part did before.

Each part's step is the one ``optimizer.step()`` would have run on it: the same averaging of the same host
gradients, the param groups as they were when backward began (:func:`~lightning_zero.engine.optimizers.
stepping_view`), torch's per-parameter state, the fused host kernel: bit for bit the serial step, which
``tests/distributed/test_offload.py`` compares. The rows still travel back, and are all-gathered, from
``optimizer.step()`` on the training thread, in the order the parts started (the collectives keep one order on every
rank), each part's gather overlapping the host step of the next. A part's step first waits for the copies of its
gradients (an event on the copy stream, which also follows the previous step's copies of those masters to the
device, queued before this backward on the compute stream).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.optim import Optimizer

from lightning_zero.engine.optimizers import stepping_view
from lightning_zero.engine.stage12.delayed_update import PendingUpdate
from lightning_zero.engine.stage12.grad_records import GradState, ParamGradient


@dataclasses.dataclass
class EarlyPart:
    """A part of the step started during backward: its buckets, its parameters' layout indices, its host step."""

    buckets: list[int]
    indices: list[int]
    pending: PendingUpdate
    buckets_in_flight: int
    """Buckets of this optimizer whose reduction had not landed yet when the part started (0: backward's end)."""


class EarlyHostSteps:
    """One optimizer's parts in the current backward: which buckets each still waits for, and those started."""

    def __init__(self) -> None:
        #: The parts started in this step, in the order they started.
        self.started: list[EarlyPart] = []
        self._waiting: dict[int, int] = {}
        self._part_of: dict[int, int] = {}
        self._view: Optimizer | None = None

    def arm(self, parts: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        """A synchronising backward begins: every part waits for all of its buckets."""
        self._part_of = {b: k for k, (buckets, _) in enumerate(parts) for b in buckets}
        self._waiting = {k: len(buckets) for k, (buckets, _) in enumerate(parts)}
        self._view = None

    def disarm(self) -> None:
        """Backward ended: nothing more starts before ``optimizer.step()``."""
        self._part_of, self._waiting = {}, {}

    def landed(self, bucket: int) -> int | None:
        """The position of the part whose last bucket this was, or None."""
        k = self._part_of.pop(bucket, None)
        if k is None:
            return None
        self._waiting[k] -= 1
        return k if self._waiting[k] == 0 else None

    @property
    def buckets_in_flight(self) -> int:
        return sum(self._waiting.values())

    def view(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer as it stands when the first part starts, for every part of this step."""
        if self._view is None:
            self._view = stepping_view(optimizer)
        return self._view

    def take(self) -> list[EarlyPart]:
        """The parts started, handed to the step that lands them."""
        started, self.started = self.started, []
        return started

    def wait(self) -> None:
        """Block until every part started so far has been stepped (before the masters or the state are read)."""
        for part in self.started:
            part.pending.wait()


def finalize_landed(records: Sequence[ParamGradient], ranks: int) -> tuple[list[torch.Tensor], float] | None:
    """What ``GradientReducer.finalize`` does to these records, for a part stepping during backward: their host copies
    become the final gradients, to be averaged over ``ranks`` by the coefficient returned (in the worker, once the
    copies have landed); ``finalize`` then leaves them alone. None, with nothing changed, where a parameter produced
    no gradient on this rank or has no host copy."""
    if not all(r.produced and r.state is GradState.REDUCED and r.staged is not None for r in records):
        return None
    grads: list[torch.Tensor] = []
    for record in records:
        if record.staged is not None:  # checked above; for the type checker
            record.state, record.final = GradState.FINALIZED, record.staged
            grads.append(record.staged)
    return grads, 1.0 / ranks
