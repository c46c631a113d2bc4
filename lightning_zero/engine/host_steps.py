"""The worker thread the offloaded host steps run in, beside training, and the bookkeeping of the two schedules that
use it: the host step during backward (stages 1-3, exact) and the one-step delayed update (stages 1-2, not exact).

[Note: the host step during backward]
With the optimizer offloaded, the host step is the longest piece of a step. Backward reduces the gradients a piece at a
time, last layers first (a bucket at stages 1-2, an FSDP2 unit at stage 3), and each piece's shards are copied to the
host as they land (see [Note: the offloaded step] in ``offload.py``). Once every piece of a part has landed, the part's
step can start in a worker thread, so the host steps the last layers while the device still computes the gradients of
the first, but only where the step's coefficient is known before backward ends:

* it is the averaging alone: no clipping, no loss scaler (``16-mixed`` can skip a step on overflow), and no user code
  between backward and the step (``on_after_backward``, ``on_before_optimizer_step``), where ``clip_grad_norm_`` or an
  edit of ``.grad`` would come too late;
* there is one backward a step, no delayed update, no hybrid replicas (their sums are added after the
  reduction), no pipeline stages, every master on the host and an element-wise torch optimizer without step
  hooks (``optimizers.steps_in_parts``);
* every parameter of the part has a gradient on this rank: whether one this rank produced none for was used on
  another rank is known only when backward ends (``GradientReducer._forget_gradients_no_rank_produced``,
  ``fsdp2_missing_grads.UnusedParameters``). At world size 1 FSDP2 copies where it would reduce
  (``fsdp2_comm``'s [Note: units finished alone]).

Each part's step is bit for bit the one ``optimizer.step()`` would have run on it, with the param groups as they were
when the first part started (:func:`~lightning_zero.engine.optimizers.stepping_view`). The rows still travel back from
``optimizer.step()`` on the training thread, in the order the parts started, because the collectives must keep one order
on every rank. Once parts were stepped, anything that could still change the gradients or skip the step is refused:
clipping by hand inside the closure (``OptimizerShards.local_gradients(for_change=True)``), and an ``optimizer_step``
override that runs the closure but not ``optimizer.step()``.

[Note: the delayed update]
Stages 1-2 (``ShardedOptimizer._step_delayed``). ZeRO-Offload's delayed parameter update (DPU) trades one step of
staleness for the time the device would idle during the host step: the host step of step ``t`` runs in a worker thread
while step ``t + 1`` computes its forward and backward with the parameters of step ``t - 1``. Every update lands, one
step late. It is not the exact step; ``tests/distributed/test_offload.py`` follows the demo GPT's loss curve against the
exact run. What stays exact is the bookkeeping:

* the thread steps a view of the user's optimizer (:func:`~lightning_zero.engine.optimizers.stepping_view`) with its own
  copies of the param groups, so an LR scheduler stepping meanwhile changes the next step, not this one;
* the gradient buffers it reads are not the ones the next backward fills (``MasterShards.swap_gradient_buffers``);
* whatever reads the masters or the optimizer state first waits for the step in flight (:meth:`HostSteps.wait`), and a
  checkpoint keeps the parameters forward computes with beside the masters (``checkpoint/delayed_update.py``), so a
  resume continues the delayed schedule exactly;
* training ends with the pending update landed.

Evaluation inside ``fit`` sees the parameters forward computes with, one update behind the masters.

[Note: the delayed update in parts]
The rows a delayed host step sends to the device read the masters the next host step writes, so that step must wait for
their copies; waiting for all of them would put every copy and the whole step end to end. The rows therefore go a part
at a time, in the order the next forward needs them, and the next host step steps the same parts in that order, each
after its own copies' event.

[Note: host-step threads]
A host step in the worker runs beside the training thread and autograd's device thread, either of which spins a core
while it waits for the device. torch's CPU kernels split their work evenly over the intra-op threads and wait for the
slowest share, so one core held by another thread slows the whole step
(``benchmarks/results/2026-11-27-host-overhead.md``, ``benchmarks/results/2026-12-04-h200.md``). With an accelerator the
worker therefore steps with :data:`CORES_LEFT_TO_TRAINING` fewer threads than the process's budget (OpenMP keeps the
count per thread, so the training thread keeps its own). On a CPU the training computes with every thread itself, and
the worker takes torch's count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.optim import Optimizer

from lightning_zero.engine.offload import MasterShards, host_kernel
from lightning_zero.engine.optimizers import hosted_params, stepping_view, steps_in_parts


@dataclasses.dataclass
class PendingUpdate:
    """A host step whose rows have not reached the device yet; ``future`` None: loaded from a checkpoint saved while one
    ran, so the masters already hold it."""

    future: Future[object] | None = None

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()


#: Cores a host step beside training leaves to the training thread and autograd's device thread (see [Note:
#: host-step threads]).
CORES_LEFT_TO_TRAINING = 2


def host_step_threads(device: torch.device | None, budget: int | None = None) -> int | None:
    """Intra-op threads for host steps beside training on ``device`` (see [Note: host-step threads]); None:
    torch's own count."""
    if device is None or device.type == "cpu":
        return None
    budget = torch.get_num_threads() if budget is None else budget
    return max(1, budget - CORES_LEFT_TO_TRAINING)


class HostSteps:
    """The worker thread one engine's host steps run in, in order. On a CUDA ``device`` the thread makes that device
    current (as DataLoader's pinning thread does): its first CUDA call would otherwise open a context on device 0
    from every rank."""

    def __init__(self, device: torch.device | None = None, threads: int | None = None) -> None:
        threads = host_step_threads(device) if threads is None else threads

        def use_device() -> None:
            if threads is not None:
                torch.set_num_threads(threads)
                torch.get_num_threads()  # torch takes a thread's count on its first query: take it now
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lightning_zero-host-step", initializer=use_device)
        self._last: Future[object] | None = None
        if threads is not None:
            # torch also records the worker's count as the one threads started later begin with: the worker takes
            # it now, and the training thread puts its own back.
            own = torch.get_num_threads()
            self._pool.submit(lambda: None).result()
            torch.set_num_threads(own)

    def start(self, step: Callable[[], object]) -> PendingUpdate:
        self._last = self._pool.submit(step)
        return PendingUpdate(self._last)

    def wait(self) -> None:
        """Block until every step started so far is done; a failure is raised by its own :class:`PendingUpdate`."""
        if self._last is not None:
            self._last.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclasses.dataclass
class EarlyPart:
    """A part of the step started during backward; ``pieces`` are buckets or units."""

    pieces: list[int]
    indices: list[int]
    pending: PendingUpdate
    pieces_in_flight: int
    """Pieces of this optimizer whose reduction had not landed yet when the part started (0: backward's end)."""


class EarlyHostSteps:
    """One optimizer's parts in the current backward (see [Note: the host step during backward])."""

    def __init__(self) -> None:
        self.started: list[EarlyPart] = []
        self._waiting: dict[int, int] = {}
        self._part_of: dict[int, int] = {}
        self._view: Optimizer | None = None
        self._worker: HostSteps | None = None

    def arm(
        self,
        optimizer: Optimizer,
        parts: Sequence[tuple[Sequence[int], Sequence[int]]],
        worker: HostSteps,
        masters: MasterShards | None,
        eligible: bool = True,
    ) -> bool:
        """A synchronising backward begins; False where nothing will start early (see the Note). Refused where the parts
        of the previous backward were never stepped."""
        if self.started:
            raise RuntimeError(
                f"The host stepped parts of {type(optimizer).__name__} during the last backward, but no "
                "`optimizer.step()` followed it (an `optimizer_step` override that runs the closure and skips the "
                "step?). Pass ZeroStrategy(overlap_comm=False) to keep the whole step for `optimizer.step()`."
            )
        starts = (
            eligible
            and masters is not None
            and masters.offloaded
            and all(masters.on_host)
            and len(parts) > 1
            and steps_in_parts(optimizer)
        )
        armed = parts if starts else []
        self._part_of = {piece: k for k, (pieces, _) in enumerate(armed) for piece in pieces}
        self._waiting = {k: len(pieces) for k, (pieces, _) in enumerate(armed)}
        self._view, self._worker = None, worker
        return starts

    def disarm(self) -> None:
        self._part_of, self._waiting, self._worker = {}, {}, None

    def landed(self, piece: int) -> int | None:
        """The position of the part whose last piece this was, or None."""
        k = self._part_of.pop(piece, None)
        if k is None or self._worker is None:
            return None
        self._waiting[k] -= 1
        return k if self._waiting[k] == 0 else None

    def start(
        self,
        optimizer: Optimizer,
        pieces: Sequence[int],
        indices: Sequence[int],
        standins: Mapping[int, tuple[torch.Tensor, torch.Tensor | None] | None],
        masters: MasterShards,
        average: tuple[list[torch.Tensor], float] | None = None,
    ) -> None:
        """Step the part ``standins`` names (``optimizers.hosted_params``) in the worker, once the gradient copies
        queued so far have landed. The view of ``optimizer`` is taken once, when the first part starts, so every part
        steps with the same param groups. ``average``: gradients the worker scales first (stages 1-2 average there)."""
        if self._worker is None:
            raise RuntimeError("lightning_zero internal error: a part started with no backward armed")
        if self._view is None:
            self._view = stepping_view(optimizer)
        view, copied = self._view, masters.gradient_copies_queued()

        def host_step() -> object:
            if copied is not None:
                copied.synchronize()
            if average is not None and average[1] != 1.0:
                torch._foreach_mul_(*average)
            with hosted_params(view, standins), host_kernel(view):
                return view.step()

        in_flight = sum(self._waiting.values())
        self.started.append(EarlyPart(list(pieces), list(indices), self._worker.start(host_step), in_flight))

    def take(self) -> list[EarlyPart]:
        started, self.started = self.started, []
        return started

    def wait(self) -> None:
        """Block until every part started so far has been stepped (before the masters or state are read)."""
        for part in self.started:
            part.pending.wait()

    def refuse(self, optimizer: Optimizer, action: str) -> None:
        """Raise where parts were stepped already, so ``action`` comes too late."""
        if self.started:
            raise RuntimeError(
                f"Cannot {action}: with the optimizer offloaded, the host already stepped parts of "
                f"{type(optimizer).__name__} during backward (see [Note: the host step during backward] in "
                "lightning_zero/engine/host_steps.py), which it does only where nothing after backward changes the "
                "gradients. Clip through Lightning (`gradient_clip_val`, `configure_gradient_clipping`), or pass "
                "ZeroStrategy(overlap_comm=False) to keep the whole step for `optimizer.step()`."
            )
