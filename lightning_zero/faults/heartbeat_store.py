"""Heartbeats through the process group's key-value store, on a thread of their own.

[Note: why store I/O has its own thread]
Measured on torch 2.13: when the process hosting the TCPStore is stopped (SIGSTOP, a hung node), a client's
``get``/``check`` blocks until it resumes, whatever ``set_timeout`` says; when that process is gone, calls fail
at once. The watchdog must act on time in both cases (end the process after SIGTERM, notice that the store
is silent), so it never touches the store itself: this thread does, and the watchdog judges the store by
how long ago a round trip last succeeded.

Keys, under the run's namespace: ``hb/<rank>`` (each rank's :class:`~lightning_zero.faults.heartbeat.Record`),
``first_failure`` (see ``failures.py``), ``finished`` (a counter the exit agreement waits on) and ``left`` (the ranks
that have read the agreement, which the store's host waits for before its process may end).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from lightning_zero.faults import failures


@dataclass
class Snapshot:
    taken_at: float = 0.0  # time.monotonic() when the round trip completed
    failure: dict[str, Any] | None = None
    records: dict[int, bytes] = field(default_factory=dict)
    finished: int = 0
    left: int = 0
    cycle: int = 0


def short(error: BaseException) -> str:
    """A store error without the C++ stack torch appends to it."""
    text = str(error).split("\nException raised from", 1)[0].splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


class HeartbeatStore:
    """Publishes this rank's record and fetches the peers' every ``period`` seconds (or when woken)."""

    def __init__(self, store: Any, namespace: str, rank: int, world_size: int, period: float) -> None:
        self.store = store
        self.namespace = namespace
        self.rank = rank
        self.world_size = world_size
        self.period = period
        self.outgoing: bytes | None = None
        self.wanted: list[int] = []
        self.failure_out: dict[str, Any] | None = None
        self.finishing = False
        self.leaving = False
        self.snapshot = Snapshot(taken_at=time.monotonic())
        self.last_ok = time.monotonic()
        self.error: str | None = None
        self._added = False
        self._left = False
        self._present: list[str] = []  # the keys known to exist (records are never deleted during a run)
        self._stop = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="lightning_zero-exchange", daemon=True)

    def key(self, rank: int) -> str:
        return f"{self.namespace}/hb/{rank}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def silent(self, now: float) -> float:
        """Seconds without a successful round trip beyond the normal period."""
        return max(0.0, now - self.last_ok - self.period)

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) for a complete round trip that started after this call."""
        target = self.snapshot.cycle + 2
        deadline = time.monotonic() + timeout
        with self._wake:
            self._wake.notify_all()
            while self.snapshot.cycle < target and not self._stop and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.notify_all()  # the exchange thread may be between cycles
                self._wake.wait(min(left, 0.05))
        return self.snapshot.cycle >= target

    def leave(self, wait_for_all: bool, timeout: float, tick: float) -> None:
        """Say that this rank read the exit agreement; with ``wait_for_all`` (the store's host) return once every rank
        has, at most ``timeout`` seconds on."""
        self.leaving = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.error is None:
            if self.flush(tick) and (not wait_for_all or self.snapshot.left >= self.world_size):
                return

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            self._cycle()
            with self._wake:
                if self._stop:
                    return
                if self.error is not None:  # the store failed: retry once per period, never faster
                    until = time.monotonic() + self.period
                    while not self._stop and time.monotonic() < until:
                        self._wake.wait(until - time.monotonic())
                else:
                    self._wake.wait(0.05 if self.finishing else self.period)
                if self._stop:
                    return

    def _cycle(self) -> None:
        store = self.store
        outgoing = self.outgoing  # taken first: a record that says "failed" was made after the failure was handed over
        try:
            if self.failure_out is not None:
                failures.record(store, self.namespace, self.failure_out)
                self.failure_out = None
            if outgoing is not None:
                store.set(self.key(self.rank), outgoing)
            if self.finishing and not self._added:
                store.add(f"{self.namespace}/finished", 1)
                self._added = True
            if self.leaving and not self._left:
                store.add(f"{self.namespace}/left", 1)
                self._left = True
            wanted = list(self.wanted)
            keys = [self.key(r) for r in wanted]
            records: dict[int, bytes] = {}
            if keys and (self._present == keys or store.check(keys)):  # one round trip once every peer published
                self._present = keys
                records = dict(zip(wanted, store.multi_get(keys)))
            else:  # a peer that has not published (yet, or ever: it failed before its first heartbeat)
                for rank, key in zip(wanted, keys):
                    if store.check([key]):
                        records[rank] = store.get(key)
            # After the records: a rank that fails writes its failure before its record says so (``failure_out`` goes
            # out first in a cycle), so a snapshot holding a failed record holds the failure too, even when that rank's
            # process (the store's host, maybe) is gone before the next round trip.
            failure = failures.read(store, self.namespace)
            finished = store.add(f"{self.namespace}/finished", 0) if self.finishing else 0
            left = store.add(f"{self.namespace}/left", 0) if self.leaving else 0
        except Exception as error:  # noqa: BLE001 - the store host is gone or the run's store was torn down
            self.error = short(error)
            return
        now = time.monotonic()
        self.last_ok, self.error = now, None
        snapshot = Snapshot(now, failure, records, finished, left, self.snapshot.cycle + 1)
        with self._wake:
            self.snapshot = snapshot
            self._wake.notify_all()
