"""Process-group timeouts: long while a run starts, ``timeout`` while it runs, lifted for known long phases.

``torch.distributed`` applies a group's timeout to every later operation on it (``_set_pg_timeout``): a gloo
collective then raises "Timed out waiting ..." in the thread that waits, NCCL's watchdog aborts the
communicator. Measured on torch 2.13 gloo: the timeout does NOT bound point-to-point waits (``isend`` /
``irecv``, which our ring collectives use), so ``collectives.py`` passes it to those ``wait`` calls itself.

[Note: when the short timeout applies]
The rendezvous and everything before the loops start (model building, checkpoint loading, a rank
downloading data in ``setup`` while the others wait at a barrier) keep the long timeout: a slow start is not
a hang. The run's ``timeout`` (plus the watchdog's margin, so its diagnosis comes first) applies from the first
``on_*_start`` hook to teardown, to every group, including groups created later (DeviceMesh and pipeline
groups: picked up at the next step). Between runs, groups get the long timeout back, so the user's own code
between two Trainers is not held to the run's limit. :func:`extended` lifts it, on every rank, for a phase
known to be one-sided and long (rank 0 writing a full checkpoint while the others wait at a barrier).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import ParamSpec, TypeVar

import torch.distributed as dist

from lightning_zero.engine.comm import collectives

RENDEZVOUS = timedelta(minutes=10)

P = ParamSpec("P")
R = TypeVar("R")


def long_timeout(timeout: timedelta) -> timedelta:
    """The rendezvous / between-runs timeout: at least 10 minutes."""
    return max(timeout, RENDEZVOUS)


def _groups() -> list[dist.ProcessGroup | None]:
    if not (dist.is_available() and dist.is_initialized()):
        return []
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {}) or [dist.group.WORLD]
    return [g for g in groups if dist.get_rank(g) >= 0]  # groups this rank belongs to


def _apply(groups: list[dist.ProcessGroup | None], seconds: float) -> None:
    limit = timedelta(seconds=seconds)
    for group in groups:
        try:
            dist.distributed_c10d._set_pg_timeout(limit, group)
        except (ValueError, RuntimeError, AttributeError):  # a backend without settable timeouts (e.g. MPI)
            pass
    collectives.set_wait_timeout(limit)


class OpTimeouts:
    """The run's operation timeouts (one per run; :data:`ACTIVE` while the run's loops run)."""

    def __init__(self, seconds: float, long: timedelta) -> None:
        self.seconds = seconds
        self.long = long.total_seconds()
        self._stack: list[tuple[float, str]] = []
        self._known = 0

    @property
    def current(self) -> float:
        return max([self.seconds, *(s for s, _ in self._stack)])

    @property
    def reason(self) -> str | None:
        return self._stack[-1][1] if self._stack else None

    def activate(self) -> None:
        global ACTIVE
        ACTIVE = self
        world = getattr(dist.distributed_c10d, "_world", None)
        self._known = len(getattr(world, "pg_map", ()) or ())
        _apply(_groups(), self.current)

    def refresh(self) -> None:
        """Groups created since (cheap: a length check per step)."""
        world = getattr(dist.distributed_c10d, "_world", None)
        if len(getattr(world, "pg_map", ()) or ()) != self._known:
            self.activate()

    def restore(self) -> None:
        global ACTIVE
        if ACTIVE is self:
            ACTIVE = None
        _apply(_groups(), self.long)

    def push(self, seconds: float, reason: str) -> None:
        self._stack.append((seconds, reason))
        _apply(_groups(), self.current)

    def pop(self) -> None:
        self._stack.pop()
        _apply(_groups(), self.current)


ACTIVE: OpTimeouts | None = None


@contextlib.contextmanager
def extended(
    seconds: float | None = None, reason: str = "a long one-sided phase", barrier: bool = True
) -> Generator[None, None, None]:
    """Lift the run's collective timeout (and the watchdog's limits) to ``seconds`` (None: the rendezvous
    timeout, at least 10 minutes) for a phase some ranks spend waiting for others, e.g. rank 0 evaluating
    alone. Enter it on every rank::

        with lightning_zero.faults.extended(600, "rank 0 evaluates alone"):
            if trainer.is_global_zero:
                evaluate()

    The block ends with a barrier (``barrier=True``), so the ranks that have nothing to do wait there, inside
    the block, rather than in the next collective after it. Outside a ZeroStrategy run it only does that."""
    active = ACTIVE
    if active is not None:
        active.push(active.long if seconds is None else float(seconds), reason)
    try:
        yield
        if barrier:
            from lightning_zero.engine.comm import collectives

            collectives.barrier()
    finally:
        if active is not None and ACTIVE is active:
            active.pop()


def extended_during(reason: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator form of :func:`extended` (no limit, no barrier: the method ends in collectives of its own) for a
    method every rank calls."""

    def wrap(function: Callable[P, R]) -> Callable[P, R]:
        import functools

        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with extended(None, reason, barrier=False):
                return function(*args, **kwargs)

        return run

    return wrap
