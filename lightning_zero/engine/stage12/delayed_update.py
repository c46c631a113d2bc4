"""The one-step delayed parameter update of ZeRO-Offload (``offload_step_delay=1``), stages 1-2.

[Note: the delayed update]
With the optimizer offloaded, an exact step leaves the device idle while the host steps the masters (on a 1.34B
GPT the host AdamW step is longer than forward and backward together). ZeRO-Offload's delayed parameter update
(DPU) trades one step of staleness for that time: the host step of step ``t`` runs in a worker thread while step
``t + 1`` computes its forward and backward with the parameters of step ``t - 1``. When step ``t + 1``'s gradients
are final, the engine waits for the host step of step ``t``, sends its rows to the device (the parameters step
``t + 2`` computes with), and starts the host step of step ``t + 1``. So every update lands, one step late: the
gradient of step ``t + 1``, taken at ``W[t - 1]``, updates ``W[t]``. It is not the exact step; ZeRO-Offload
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
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class PendingUpdate:
    """A host step whose rows have not reached the device yet: running (``future``), or loaded with a checkpoint
    that was saved while one was (``future`` None: the masters already hold it)."""

    future: Future[object] | None = None

    def wait(self) -> None:
        """Block until the host step is done; its exception, if it failed, is raised here."""
        if self.future is not None:
            self.future.result()


class HostSteps:
    """The worker thread the delayed host steps run in, one engine's steps in the order they were started."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_zero-host-step")
        self._last: Future[object] | None = None

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
