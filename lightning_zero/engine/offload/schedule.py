"""When an optimizer's offloaded step runs: the one schedule both engines use, in three modes that differ in
where and when the parts are stepped, never in how (``host_step.step_on_host``).

* :attr:`StepMode.SERIAL`: after backward, on the training thread, a part at a time, each part's rows sent back as
  soon as it is stepped;
* :attr:`StepMode.DURING_BACKWARD`: a part whose pieces all landed starts in the worker while backward runs; the
  step sends those parts' rows back in the order they started, then steps the rest serially;
* :attr:`StepMode.DELAYED`: the whole step goes to the worker after ``optimizer.step()`` returns, and its rows
  reach the device at the next step.

Part, piece (a bucket at stages 1-2, a unit at stage 3), landed: [Note: vocabulary] in ``engine/__init__.py``.

[Note: the offloaded step]
With ``offload_optimizer`` the optimizer is re-hosted (see ``stage12/sharded_optimizer.py``) on fp32 master rows in
host memory, so its state is born there too. One step is then:

1. device->host, during backward: as each bucket's reduction lands, its reduced shards are copied, cast to fp32, into
   reused host buffers, so no fp32 gradient shard is ever made on the device. A later backward of the same window copies
   the bucket again, so the host always holds the final sum. Averaging, unscaling, clipping and the overflow check all
   read the host copies;
2. the user's optimizer steps the host masters (torch's fused CPU kernel where the user did not choose one, see
   ``host_step.host_kernel``), a few buckets at a time where the optimizer's state is per parameter
   (``optimizers.steps_in_parts``); a part may start during backward (see [Note: the host step during backward]);
3. host->device: each part's rows are copied to the device's parameter shard and all-gathered as soon as the part is
   stepped, so the copies of one part overlap the host step of the next.

With an accelerator the host buffers are pinned, the copies are ``non_blocking`` and the gradient copies run on a stream
of their own (``masters.CopyStream``) to overlap the rest of backward. The host waits for them once, when the
gradients are finalized; that wait also covers the previous step's parameter copies queued on the compute stream, so a
pinned master is never written while its copy to the device is in flight. On a CPU-only machine nothing is pinned and
the same copies run synchronously in the same order, so CI exercises the offload schedule bit for bit.

[Note: the host step during backward]
With the optimizer offloaded, the host step is the longest piece of a step. Backward reduces the gradients a piece at a
time, last layers first (a bucket at stages 1-2, an FSDP2 unit at stage 3), and each piece's shards are copied to the
host as they land (see [Note: the offloaded step]). Once every piece of a part has landed, the part's
step can start in a worker thread, so the host steps the last layers while the device still computes the gradients of
the first, but only where the step's coefficient is known before backward ends, or can be checked after it:

* it is the averaging alone, or with Lightning's clipping by the global norm (``gradient_clip_val``), whose
  coefficient the parts speculate is 1 and undo where it is not ([Note: speculative clipping] in
  ``speculation.py``); no loss scaler (``16-mixed`` can skip a step on overflow), and no user code between backward
  and the step (``on_after_backward``, ``on_before_optimizer_step``), where ``clip_grad_norm_`` or an edit of
  ``.grad`` would come too late;
* there is one backward a step, no delayed update, no hybrid replicas (their sums are added after the
  reduction), no pipeline stages, everything the parts step on the host (every master, or stage 3's offloaded
  parameters themselves) and an element-wise torch optimizer without step hooks (``optimizers.steps_in_parts``);
* every parameter of the part has a gradient on this rank: whether one this rank produced none for was used on
  another rank is known only when backward ends (``GradientReducer._forget_gradients_no_rank_produced``,
  ``fsdp2_missing_grads.UnusedParameters``). At world size 1 FSDP2 copies where it would reduce
  (``fsdp2_comm``'s [Note: units finished alone]).

Each part's step is bit for bit the one ``optimizer.step()`` would have run on it, with the param groups as they were
when the first part started (:func:`~lightning_zero.engine.optimizers.stepping_view`). The rows still travel back from
``optimizer.step()`` on the training thread, in the order the parts started, because the collectives must keep one order
on every rank. Once parts were stepped, anything that could still change the gradients or skip the step is refused:
clipping by hand inside the closure (``OptimizerShards.local_gradients(for_change=True)``), and an ``optimizer_step``
override that runs the closure but not ``optimizer.step()``; parts stepped speculatively are put back instead
([Note: speculative clipping] in ``speculation.py``) and stepped after the change.

[Note: the delayed update]
Stages 1-2 (:attr:`StepMode.DELAYED`). ZeRO-Offload's delayed parameter update (DPU) trades one step of
staleness for the time the device would idle during the host step: the host step of step ``t`` runs in a worker thread
while step ``t + 1`` computes its forward and backward with the parameters of step ``t - 1``. Every update lands, one
step late. It is not the exact step; ``tests/distributed/test_offload.py`` follows the demo GPT's loss curve against the
exact run. What stays exact is the bookkeeping:

* the thread steps a view of the user's optimizer (:func:`~lightning_zero.engine.optimizers.stepping_view`) with its own
  copies of the param groups, so an LR scheduler stepping meanwhile changes the next step, not this one;
* the gradient buffers it reads are not the ones the next backward fills (``MasterShards.swap_gradient_buffers``);
* whatever reads the masters or the optimizer state first waits for the step in flight
  (:meth:`HostStepSchedule.settle`), and a checkpoint keeps the parameters forward computes with beside the masters
  (``checkpoint/delayed_update.py``), so a resume continues the delayed schedule exactly;
* training ends with the pending update landed.

Evaluation inside ``fit`` sees the parameters forward computes with, one update behind the masters.

[Note: the delayed update in parts]
The rows a delayed host step sends to the device read the masters the next host step writes, so that step must wait for
their copies; waiting for all of them would put every copy and the whole step end to end. The rows therefore go a part
at a time, in the order the next forward needs them, and the next host step steps the same parts in that order, each
after its own copies' event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.offload.host_step import step_on_host
from lightning_zero.engine.offload.speculation import CopyBuffers, Speculation
from lightning_zero.engine.offload.worker import HostStepWorker, PendingUpdate
from lightning_zero.engine.optimizers import Standins, stepping_view, steps_in_parts
from lightning_zero.engine.state_dtype import StateDtype

#: Enough parts that the copies behind the last one are short, few enough that the optimizer's per-call overhead
#: stays small.
HOST_STEP_PARTS = 8


def split_in_parts(sizes: Sequence[int], parts: int = HOST_STEP_PARTS) -> list[list[int]]:
    """Consecutive runs of ``sizes``' positions, each about ``1/parts`` of the total."""
    target = sum(sizes) / max(parts, 1)
    runs: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for position, size in enumerate(sizes):
        current.append(position)
        filled += size
        if filled >= target:
            runs.append(current)
            current, filled = [], 0
    if current:
        runs.append(current)
    return runs


class StepMode(enum.Enum):
    """Where and when this step's parts are stepped (see the module's docstring)."""

    SERIAL = enum.auto()
    DURING_BACKWARD = enum.auto()
    DELAYED = enum.auto()


@dataclasses.dataclass(frozen=True)
class HostPart:
    """A part of the step: the pieces whose reductions bring its gradients, and the engine's trainable parameters
    it steps."""

    pieces: tuple[int, ...]
    indices: tuple[int, ...]


@dataclasses.dataclass
class StartedPart:
    """A part started in the worker during backward."""

    part: HostPart
    pending: PendingUpdate
    pieces_in_flight: int
    """Pieces of this optimizer whose reduction had not landed yet when the part started (0: backward's end)."""
    speculated: list[Speculation] = dataclasses.field(default_factory=list)
    """Under clipping, what the worker noted before the step (see [Note: speculative clipping] in
    ``speculation.py``): filled in the worker, read once the part is done."""


#: One host-step call of the delayed update: its stand-ins and the event behind the copies that read its masters.
PartStep = tuple[Standins, "torch.Event | None"]


class HostStepSchedule:
    """One optimizer's offloaded step over its parts: the mode, the parts started during backward, the delayed update
    in flight, and the engine's worker they run in."""

    def __init__(
        self, optimizer: Optimizer, worker: HostStepWorker, *, delayed: bool = False, states: StateDtype | None = None
    ) -> None:
        self.optimizer = optimizer
        self.worker = worker
        self.delayed = delayed
        #: The dtype the optimizer's state is held in between steps; every call of the step goes through it.
        self.states = states if states is not None else StateDtype()
        self.started: list[StartedPart] = []
        #: The delayed update whose rows have not reached the device.
        self.pending: PendingUpdate | None = None
        self._waiting: dict[int, int] = {}
        self._part_of: dict[int, int] = {}
        self._armed: list[HostPart] = []
        self._view: Optimizer | None = None
        #: The parts started this backward step before the clipping coefficient is known.
        self._speculating = False
        #: Their copies' buffers, kept from step to step.
        self._copies = CopyBuffers()
        #: Whether the worker's gradient norms stand in for the clip's own (``Speculation.before_step``).
        self._norms_here = True

    @property
    def mode(self) -> StepMode:
        """The mode of the step about to run (after its backward)."""
        if self.delayed:
            return StepMode.DELAYED
        return StepMode.DURING_BACKWARD if self.started else StepMode.SERIAL

    # ------------------------------------------------------------------ during backward
    @property
    def speculated(self) -> bool:
        """Parts started during this backward before the clipping coefficient was known (see [Note: speculative
        clipping] in ``speculation.py``)."""
        return self._speculating and bool(self.started)

    def arm(
        self,
        parts: Sequence[HostPart],
        on_host: bool,
        eligible: bool = True,
        speculative: bool = False,
        norms_here: bool = True,
    ) -> bool:
        """A synchronising backward begins; False where nothing will start early (see [Note: the host step during
        backward]); ``on_host``: every tensor the parts step is in host memory (masters, or stage 3's offloaded
        parameters); ``speculative``: the step clips by the global norm, so parts start speculatively
        (``norms_here``: see ``Speculation.before_step``). Refused where the parts of the previous backward were never
        stepped."""
        if self.started:
            raise RuntimeError(
                f"The host stepped parts of {type(self.optimizer).__name__} during the last backward, but no "
                "`optimizer.step()` followed it (an `optimizer_step` override that runs the closure and skips the "
                "step?). Pass ZeroStrategy(overlap_comm=False) to keep the whole step for `optimizer.step()`."
            )
        starts = eligible and not self.delayed and on_host and len(parts) > 1 and steps_in_parts(self.optimizer)
        self._armed = list(parts) if starts else []
        self._part_of = {piece: k for k, part in enumerate(self._armed) for piece in part.pieces}
        self._waiting = {k: len(part.pieces) for k, part in enumerate(self._armed)}
        self._view = None
        self._speculating, self._norms_here = starts and speculative, norms_here
        self._copies.forget_unused()
        return starts

    def disarm(self) -> None:
        self._part_of, self._waiting, self._armed = {}, {}, []

    def landed(self, piece: int) -> HostPart | None:
        """The part whose last piece this was, or None."""
        k = self._part_of.pop(piece, None)
        if k is None:
            return None
        self._waiting[k] -= 1
        return self._armed[k] if self._waiting[k] == 0 else None

    def start(
        self,
        part: HostPart,
        standins: Standins,
        after: torch.Event | None,
        average: tuple[list[torch.Tensor], float] | None = None,
        inner: Callable[[Optimizer], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        """Step ``part`` in the worker once the copies behind ``after`` are done (``inner``: see
        ``host_step.step_on_host``). The view of the optimizer is taken when the first part starts, so every part
        steps with the same param groups."""
        if self._view is None:
            self._view = stepping_view(self.optimizer)
        view = self._view
        speculated: list[Speculation] = []

        def note() -> None:
            speculated.append(Speculation.before_step(view, standins, self._copies, take_norms=self._norms_here))

        before = note if self._speculating else None
        pending = self.worker.start(
            lambda: step_on_host(
                view, standins, after=after, average=average, states=self.states, before=before, inner=inner
            )
        )
        self.started.append(StartedPart(part, pending, sum(self._waiting.values()), speculated))

    def take(self) -> list[StartedPart]:
        """The parts started during the backward that just ended, for :meth:`send_back`; the schedule forgets them."""
        started, self.started = self.started, []
        return started

    @staticmethod
    def send_back(started: Sequence[StartedPart], send: Callable[[HostPart], None]) -> set[int]:
        """Send the started parts' rows to the device in the order they started, which is the same on every rank;
        returns the parameters they stepped."""
        stepped: set[int] = set()
        for each in started:
            each.pending.wait()
            send(each.part)
            stepped.update(each.part.indices)
        return stepped

    def speculated_norms(self) -> dict[int, torch.Tensor]:
        """``id(gradient)`` -> its 2-norm, for the gradients of the parts started speculatively, once they are done."""
        self.wait_started()
        return {key: norm for each in self.started for noted in each.speculated for key, norm in noted.norms.items()}

    def undo_started(self) -> None:
        """The clip fired: every part started speculatively is put back as it was before its step and forgotten, so
        the step steps it again with the clipped gradients (see [Note: speculative clipping])."""
        self.wait_started()
        for each in reversed(self.started):
            for noted in each.speculated:
                noted.undo(self.optimizer)
        self.started, self._speculating = [], False

    def wait_started(self) -> None:
        """Block until every part started so far has been stepped (before its gradients or masters are read)."""
        for each in self.started:
            each.pending.wait()

    def refuse(self, action: str) -> None:
        """Raise where parts were stepped already, so ``action`` comes too late (speculated parts the caller puts
        back first, with :meth:`undo_started`)."""
        if self.started:
            raise RuntimeError(
                f"Cannot {action}: with the optimizer offloaded, the host already stepped parts of "
                f"{type(self.optimizer).__name__} during backward (see [Note: the host step during backward] in "
                "lightning_zero/engine/offload/schedule.py), which it does only where nothing after backward changes "
                "the gradients. Clip through Lightning (`gradient_clip_val`, `configure_gradient_clipping`), or pass "
                "ZeroStrategy(overlap_comm=False) to keep the whole step for `optimizer.step()`."
            )

    # ------------------------------------------------------------------ after backward, on this thread
    def step_serially(
        self,
        runs: Iterable[tuple[HostPart, Standins, torch.Event | None]],
        send: Callable[[HostPart], None],
        **kwargs: Any,
    ) -> object:
        """Step each run's part on this thread and send its rows at once, so the copies of one part overlap the host
        step of the next. ``runs`` may be a generator: a part's stand-ins are made when its turn comes."""
        result = None
        for part, standins, after in runs:
            result = step_on_host(self.optimizer, standins, after=after, states=self.states, **kwargs)
            send(part)
        return result

    # ------------------------------------------------------------------ the delayed update
    def start_delayed(self, runs: Sequence[PartStep], **kwargs: Any) -> None:
        """Step every run in the worker, in order, each after its own copies' event (see [Note: the delayed update in
        parts]), on a view of the optimizer taken now."""
        view = stepping_view(self.optimizer)

        def step() -> object:
            result = None
            for standins, after in runs:
                result = step_on_host(view, standins, after=after, states=self.states, **kwargs)
            return result

        self.pending = self.worker.start(step)

    def take_pending(self) -> PendingUpdate | None:
        pending, self.pending = self.pending, None
        return pending

    def settle(self) -> None:
        """Wait for every host step in flight, started during backward or delayed, before the masters or the
        optimizer's state are read."""
        if self.pending is not None:
            self.pending.wait()
        self.wait_started()


def runs_behind_copies(
    optimizer: Optimizer,
    parts: Sequence[HostPart],
    params: Sequence[nn.Parameter],
    standins: Standins,
    sent: Sequence[torch.Event | None],
    all_sent: torch.Event | None,
) -> list[PartStep]:
    """The delayed update's runs: one per part behind the copies of its own rows (``sent``), or one call behind
    ``all_sent`` where the rows did not go a part at a time or ``optimizer`` cannot step in parts."""
    if len(sent) != len(parts) or len(parts) < 2 or not steps_in_parts(optimizer):
        return [(standins, all_sent)]
    runs: list[PartStep] = []
    for part, copied in zip(parts, sent):
        ids = {id(params[i]) for i in part.indices}
        runs.append(({key: standin if key in ids else None for key, standin in standins.items()}, copied))
    return runs
