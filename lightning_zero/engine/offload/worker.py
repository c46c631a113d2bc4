"""The worker thread the offloaded host steps run in, beside training: the host step during backward (stages 1-3,
exact), the one-step delayed update and selective updates' host step (stages 1-2, not exact); when each runs is
``schedule.py``'s and ``selective.py``'s.

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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


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


class HostStepWorker:
    """The worker thread one engine's host steps run in, in order, started by the first of them. On a CUDA ``device``
    the thread makes that device current (as DataLoader's pinning thread does): its first CUDA call would otherwise
    open a context on device 0 from every rank."""

    def __init__(self, device: torch.device | None = None, threads: int | None = None) -> None:
        self._device = device
        self._threads = host_step_threads(device) if threads is None else threads
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[object] | None = None

    def _started_pool(self) -> ThreadPoolExecutor:
        if self._pool is not None:
            return self._pool
        device, threads = self._device, self._threads

        def use_device() -> None:
            if threads is not None:
                torch.set_num_threads(threads)
                torch.get_num_threads()  # torch takes a thread's count on its first query: take it now
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)

        pool = self._pool = ThreadPoolExecutor(1, thread_name_prefix="lightning_zero-host-step", initializer=use_device)
        if threads is not None:
            # torch also records the worker's count as the one threads started later begin with: the worker takes
            # it now, and the training thread puts its own back.
            own = torch.get_num_threads()
            pool.submit(lambda: None).result()
            torch.set_num_threads(own)
        return pool

    def start(self, step: Callable[[], object]) -> PendingUpdate:
        self._last = self._started_pool().submit(step)
        return PendingUpdate(self._last)

    def wait(self) -> None:
        """Block until every step started so far is done; a failure is raised by its own :class:`PendingUpdate`."""
        if self._last is not None:
            self._last.exception()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
