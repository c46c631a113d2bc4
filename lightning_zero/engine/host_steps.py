"""The worker thread the offloaded host steps run in, beside training, and the bookkeeping of the two schedules that
use it: the host step during backward (stages 1-3, exact) and the one-step delayed update (stages 1-2, not exact).

[Note: the host step during backward]
With the optimizer offloaded, the host step is the longest piece of a step on a GPU (the host AdamW step of a 1.34B
GPT takes longer than its forward and backward together), and it used to start only when ``optimizer.step()`` was
called. Backward reduces the gradients a piece at a time, last layers first (a bucket at stages 1-2, an FSDP2 unit at
stage 3), and each piece's reduced shards are copied to the host as it lands (see [Note: the offloaded step] in
``offload.py``); once every piece of a part of the step has landed, nothing but the step's coefficient and the
used-parameter flags stands between those gradients and the step. Where both are known before backward ends, the
part's step starts at once in a worker thread, so the host steps the last layers while the device still computes the
gradients of the first. It is used in a synchronising backward where, besides ``overlap_comm`` (the default):

* the step's coefficient is the averaging alone: no clipping (``gradient_clip_val`` unset and
  ``configure_gradient_clipping`` not overridden), no loss scaler (``16-mixed`` can skip a step on overflow), and
  no code of the user's between backward and the step (``on_after_backward`` or ``on_before_optimizer_step`` of
  the module or of a callback, where ``clip_grad_norm_`` or an edit of ``.grad`` would come too late);
* there is one backward a step (automatic optimization; at stages 1-2 a second backward into a part already stepped
  is refused by the reducer, loudly), no delayed update, no hybrid replicas (their sums are added after the
  reduction), no pipeline stages, every master on the host and an element-wise torch optimizer without step hooks
  (``optimizers.steps_in_parts``);
* every parameter of the part has a gradient on this rank: whether a parameter this rank produced none for was
  used on some other rank is known only when backward ends (stages 1-2:
  ``GradientReducer._forget_gradients_no_rank_produced``; stage 3: ``fsdp2_missing_grads.UnusedParameters``, which reduces
  a zero gradient for it meanwhile). Such a part waits for ``optimizer.step()``, as every part did before. At world
  size 1 FSDP2 copies where it would reduce, and each unit is announced when it has done so (``fsdp2_comm``'s [Note:
  units finished alone]).

Each part's step is the one ``optimizer.step()`` would have run on it: the same averaging of the same host gradients
(stages 1-2 average in the worker; FSDP2 averaged already), the param groups as they were when the first part
started (:func:`~lightning_zero.engine.optimizers.stepping_view`), torch's per-parameter state, the fused host
kernel: bit for bit the serial step, which ``tests/distributed/test_offload.py`` compares. The rows still travel back
(and, at stages 1-2, are all-gathered) from ``optimizer.step()`` on the training thread, in the order the parts
started (the collectives keep one order on every rank), each part's copies overlapping the host step of the next. A
part's step first waits for the copies of its gradients (an event on the copy stream, which also follows the
previous step's copies of those masters to the device, queued before this backward).

What may still change the gradients or skip the step after backward is refused once parts were stepped, with the
fix in the message: clipping by hand inside the step's closure (``OptimizerShards.local_gradients(for_change=True)``),
and an ``optimizer_step`` override that runs the closure but not ``optimizer.step()`` (found at the next backward,
or at the skipped step's ``discard_gradients``).

[Note: the delayed update]
Stages 1-2 (``ShardedOptimizer._step_delayed``). With the optimizer offloaded, an exact step leaves the device
idle while the host steps the masters (on a 1.34B GPT the host AdamW step is longer than forward and backward
together). ZeRO-Offload's delayed parameter update (DPU) trades one step of staleness for that time: the host
step of step ``t`` runs in a worker thread while step ``t + 1`` computes its forward and backward with the
parameters of step ``t - 1``. When step ``t + 1``'s gradients are final, the engine waits for the host step of step
``t``, sends its rows to the device (the parameters step ``t + 2`` computes with), and starts the host step of step
``t + 1``. So every update lands, one step late: the gradient of step ``t + 1``, taken at ``W[t - 1]``, updates
``W[t]``. It is not the exact step; ZeRO-Offload
reports no loss of accuracy after the first steps, and ``tests/distributed/test_offload.py`` follows the demo
GPT's loss curve against the exact run.

What stays exact is the bookkeeping:

* the step in the thread steps a *view* of the user's optimizer (:func:`~lightning_zero.engine.optimizers.
  stepping_view`): its own copies of the param groups, taken when the step starts, and the optimizer's own state.
  The learning rate is the one of step ``t`` however late the thread runs, and an LR scheduler stepping the
  optimizer's groups meanwhile changes the next step's, not this one's;
* the gradient buffers it reads are not the ones the next backward fills (``MasterShards.swap_gradient_buffers``:
  one more fp32 gradient shard in host memory, ``4 P / N`` bytes);
* whatever reads the masters or the optimizer state (a checkpoint, ``full_state_dict``, loading one) first waits
  for the step in flight (:meth:`HostSteps.wait`), and a checkpoint keeps the parameters forward computes with
  beside the masters (``checkpoint/delayed_update.py``): a resume continues the delayed schedule exactly, and a
  run without the delay resumes from the masters, as if the pending update had landed;
* training ends with the pending update landed: the module holds every step's update.

Evaluation inside ``fit`` sees the parameters forward computes with, one update behind the masters.

[Note: the delayed update in parts]
The rows a delayed host step sends to the device read the masters the next host step writes, so that step must wait
for their copies. Waiting for all of them put every copy and the whole step end to end on the host's side of the
schedule, each step, where the copies of a large model's fp32 rows take half as long as its step. The rows go a
part at a time (the offloaded step's parts: runs of buckets in the order the next forward needs them), an event
behind each part's copies, and the next host step steps the same parts in that order, each after its own event:
the first part starts once its own rows have left, and the later parts' copies run while the earlier parts step.
Each parameter's update is the one of a single call over all of them (``optimizers.steps_in_parts``; an optimizer
that cannot step in parts steps in one call behind every copy).

[Note: host-step threads]
A host step in the worker runs beside the threads that drive an accelerator: the training thread (the next forward,
the parts' copies) and autograd's device thread (backward's kernels), either of which spins a core while it waits for
the device. torch's CPU kernels split their work evenly over the intra-op threads and wait for the slowest share, so
a core another thread holds slows the whole step, on 2 CPU cores (``benchmarks/bench_host_step.py --busy 1``,
``benchmarks/results/2026-11-27-host-overhead.md``) as on an H200 (``benchmarks/results/2026-12-04-h200.md``).
With an accelerator the worker steps with :data:`CORES_LEFT_TO_TRAINING` fewer threads than the process's budget
(OpenMP keeps the count per thread, so the training thread keeps its own). On a CPU the training computes with every
thread itself, and the worker takes torch's count.
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
    """A host step whose rows have not reached the device yet: running (``future``), or loaded with a checkpoint
    that was saved while one was (``future`` None: the masters already hold it)."""

    future: Future[object] | None = None

    def wait(self) -> None:
        """Block until the host step is done; its exception, if it failed, is raised here."""
        if self.future is not None:
            self.future.result()


#: Cores a host step beside training leaves to the training thread and autograd's device thread (see [Note:
#: host-step threads]).
CORES_LEFT_TO_TRAINING = 2


def host_step_threads(device: torch.device | None, budget: int | None = None) -> int | None:
    """Intra-op threads for host steps beside training on ``device`` (see [Note: host-step threads]); None: torch's
    own count. ``budget``: the process's threads (default ``torch.get_num_threads()``)."""
    if device is None or device.type == "cpu":
        return None
    budget = torch.get_num_threads() if budget is None else budget
    return max(1, budget - CORES_LEFT_TO_TRAINING)


class HostSteps:
    """The worker thread host steps run in, one engine's steps in the order they were started, with ``threads``
    intra-op threads (default :func:`host_step_threads`). On a CUDA ``device`` the thread works with that device
    current (as DataLoader's pinning thread does): its first CUDA call (waiting for a copy's event) would otherwise
    open a context on device 0 from every rank."""

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
        """Block until every step started so far is done (the thread runs them in order; a failure is raised by
        the :class:`PendingUpdate` of its own step, when it lands)."""
        if self._last is not None:
            self._last.exception()

    def close(self) -> None:
        """Finish what runs and stop the thread (teardown; a failed step's error is not raised again here)."""
        self._pool.shutdown(wait=True)


@dataclasses.dataclass
class EarlyPart:
    """A part of the step started during backward: its pieces (buckets or units), its parameters' indices in the
    engine, its host step."""

    pieces: list[int]
    indices: list[int]
    pending: PendingUpdate
    pieces_in_flight: int
    """Pieces of this optimizer whose reduction had not landed yet when the part started (0: backward's end)."""


class EarlyHostSteps:
    """One optimizer's parts in the current backward (see [Note: the host step during backward]): which pieces each
    still waits for, and those started."""

    def __init__(self) -> None:
        #: The parts started in this step, in the order they started.
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
        """A synchronising backward begins: every part waits for all of its pieces, and will step in ``worker``; False,
        with nothing to start, unless the engine finds it ``eligible``, every master is on the host, there are two
        parts or more and ``optimizer`` steps in parts (see the Note). Refused where the parts of the previous
        backward were never stepped."""
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
        """Backward ended: nothing more starts before ``optimizer.step()``."""
        self._part_of, self._waiting, self._worker = {}, {}, None

    def landed(self, piece: int) -> int | None:
        """The position of the part whose last piece this was, or None (also when nothing is armed)."""
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
        """Step the part ``standins`` names (``optimizers.hosted_params``) in the worker, on the view of ``optimizer``
        taken when this step's first part started, once the gradient copies queued so far have landed; ``average``:
        gradients the worker multiplies by a coefficient first (stages 1-2 average there)."""
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
        """The parts started, handed to the step that lands them."""
        started, self.started = self.started, []
        return started

    def wait(self) -> None:
        """Block until every part started so far has been stepped (before the masters or the state are read)."""
        for part in self.started:
            part.pending.wait()

    def refuse(self, optimizer: Optimizer, action: str) -> None:
        """Raise where parts were stepped already, so ``action`` (which changes the gradients or skips the step)
        comes too late."""
        if self.started:
            raise RuntimeError(
                f"Cannot {action}: with the optimizer offloaded, the host already stepped parts of "
                f"{type(optimizer).__name__} during backward (see [Note: the host step during backward] in "
                "lightning_zero/engine/host_steps.py), which it does only where nothing after backward changes the "
                "gradients. Clip through Lightning (`gradient_clip_val`, `configure_gradient_clipping`), or pass "
                "ZeroStrategy(overlap_comm=False) to keep the whole step for `optimizer.step()`."
            )
