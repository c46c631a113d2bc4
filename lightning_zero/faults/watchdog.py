"""The collective watchdog: one daemon thread per rank that notices a run that cannot go on, names the rank
and the collective, and makes every rank end within ``timeout`` (plus a few seconds) even under NCCL's
semantics, where nothing raises.

Each tick (``Limits.tick``, 1 s) the thread samples the main thread (``activity.py``), publishes this rank's
record through :class:`~lightning_zero.faults.heartbeat_store.HeartbeatStore`, and runs :func:`diagnosis.decide` over the
peers' records. On a decision it (1) prints the diagnosis to stderr, (2) records it as the run's first
failure so every rank's error carries the same text, (3) arms the flight recorder so the main thread raises
it at its next collective or step, and (4) if the main thread has not started handling an error
``Limits.abort_grace`` later (it is blocked: NCCL, or a peer that is stopped but alive), flushes output and
ends the process with ``os._exit(1)``.

[Note: SIGTERM]
The thread also reads the wakeup pipe (``signals.py``). After SIGTERM the main thread normally stops at the
next batch boundary (Lightning raises ``SIGTERMException`` there). If instead it waits in one collective for
``Limits.sigterm_stall`` seconds, or has not ended ``Limits.sigterm_grace`` (25 s) after the signal, the process
ends (exit code 143), within a scheduler's usual 30 s before SIGKILL.

[Note: a pause, not a busy machine]
A rank whose own process could not run (stopped by SIGSTOP or a debugger, swapped out) while its peers gave up on it
must say so, not blame the peers that ended meanwhile. The wall clock alone cannot tell that from a busy machine: with
more runnable threads than cores (data loader workers, a second job, a test session starting processes) a watchdog
thread can wait seconds for a core. So a gap between ticks longer than ``stale_after`` counts as a pause only when the
kernel says the watchdog thread neither ran nor waited runnable for most of it (:func:`heartbeat.scheduled_seconds` of
that thread: the process's other threads may have worked or waited for a core just before it was stopped; where the
kernel cannot say, no pause is claimed and the diagnosis says what the peers show), nor did any other thread of the
process (one that did held the interpreter's lock through a long call, a compile or an operator that keeps it, and the
watchdog waited for the lock, asleep: a 19 s ``compile()`` left it 0.15 s scheduled), and only for ``2 * stale_after``
after it ended: the "meanwhile" of the diagnosis, not a stall at start-up blamed for a peer's death an hour later. A
peer on this host without heartbeat is judged the same way: silent but running or runnable is busy, not stale
(``Peer.ran``), and so is one still reading or writing the disk in the second half of its silence
(:func:`heartbeat.disk_io`: asleep on page faults or writes, as a process loading its libraries or writing a checkpoint
is where the page cache keeps little, slow but neither stopped nor hung; a SIGSTOP ends them); the collective's
``timeout`` still bounds the wait.

[Note: the exit agreement]
A rank that finishes its loop must not report success while a peer still waits in a collective it will
never join (uneven data), because the peer then hangs forever under NCCL. :meth:`Watchdog.finish` publishes
"finished" and waits (at most ``timeout``) until every rank has finished, or raises if one failed or waits
in a collective. Rank 0, whose process hosts the store by default, then waits until every rank has read that
outcome: a script ending right after ``fit`` closed the store under a peer still reading it.
"""

from __future__ import annotations

import faulthandler
import os
import select
import sys
import threading
import time
from typing import Any

from lightning_zero.engine.comm.flight import RECORDER, CollectiveError, Mark
from lightning_zero.faults import activity as activity_mod
from lightning_zero.faults import diagnosis, failures, postmortem, timeouts
from lightning_zero.faults.activity import Activity
from lightning_zero.faults.diagnosis_types import Context, Diagnosis, Limits
from lightning_zero.faults.heartbeat import (
    FAILED,
    FINISHED,
    RUNNING,
    Peer,
    Record,
    disk_io,
    liveness,
    local_pid,
    scheduled_seconds,
    this_process,
    thread_schedules,
)
from lightning_zero.faults.heartbeat_store import HeartbeatStore
from lightning_zero.faults.signals import STOP_SIGNALS, StopSignal, WakeupPipe


def paused_for(
    gap: float, was: dict[int, float] | None, now: dict[int, float] | None, own: int | None, limits: Limits
) -> float:
    """``gap`` if the process could not run over it, else 0.0, from every thread's scheduled seconds before and after
    (:func:`heartbeat.thread_schedules`; ``own``: the watchdog thread's id). See [Note: a pause, not a busy machine]."""
    if gap <= limits.stale_after or was is None or now is None or own not in was or own not in now:
        return 0.0  # short, or no evidence: the diagnosis says what the peers show instead
    if now[own] - was[own] >= gap / 2:
        return 0.0  # running or runnable for most of it: a busy machine
    others = (seconds - was.get(task, 0.0) for task, seconds in now.items() if task != own)
    if max(others, default=0.0) >= gap / 2:
        return 0.0  # another thread ran meanwhile: it held the interpreter's lock the watchdog waited for
    return gap


class Watchdog:
    def __init__(
        self,
        store: Any,
        namespace: str,
        rank: int,
        world_size: int,
        limits: Limits,
        context: Context,
        group: Any,
        mark_peer: int | None,
        long: float = 600.0,
    ) -> None:
        self.rank = rank
        self.long = long  # seconds: the limit before the loops start
        self.world_size = world_size
        self.limits = limits
        self.context = context
        self.group = group
        self.mark_peer = mark_peer
        self.namespace = namespace
        self.exchange = HeartbeatStore(store, namespace, rank, world_size, limits.tick)
        self.exchange.wanted = [r for r in range(world_size) if r != rank] if world_size <= 16 else self._neighbours()
        self.pipe = WakeupPipe()
        self.state = RUNNING
        self.error: str | None = None
        self.decision: Diagnosis | None = None
        self.failing = False  # the main thread handles an error (on_exception)
        self.finishing = False
        self.stop_signal: StopSignal | None = None
        self._exit_at: float | None = None
        self._grace = 0.0
        self._pause: tuple[float, float] | None = (
            None  # (seconds, when it ended): see [Note: a pause, not a busy machine]
        )
        self._last_tick = time.monotonic()
        #: The watchdog thread's own id, whose schedule tells a pause (see the Note); set when it starts.
        self._thread_id: int | None = None
        #: Every thread's scheduled seconds at the last tick (see the Note).
        self._last_threads: dict[int, float] | None = None
        # ((ops, seq, last mark), since)
        self._progress: tuple[tuple[int, int, Mark | None] | tuple[()], float] = ((), time.monotonic())
        self._beat = 0
        # rank -> (beat, snapshot time it was first seen, its process's scheduled seconds then)
        self._seen: dict[int, tuple[int, float, float | None]] = {}
        # rank -> (its process's disk traffic, snapshot time it last changed)
        self._disk: dict[int, tuple[tuple[int, int, int] | None, float]] = {}
        self._blocked: tuple[tuple[str | None, int], float] | None = None  # a wait outside collectives.py: (key, since)
        self._stop = False
        self._main = threading.get_ident()
        self._proc = this_process()
        self.blackbox: postmortem.BlackBox | None = None
        self._faulthandler = False
        self._thread = threading.Thread(target=self._run, name="lightning_zero-watchdog", daemon=True)

    def _neighbours(self) -> list[int]:
        wanted = {(self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size}
        if self.mark_peer is not None:
            wanted.add(self.mark_peer)
        return sorted(wanted - {self.rank})

    # ------------------------------------------------------------------ lifecycle (main thread)
    def start(self) -> None:
        RECORDER.reset(self.group)
        RECORDER.enabled = True
        # A process that dies in native code (gloo aborts on a mismatched collective) leaves its last collectives and
        # its Python stack for the peers on its host (postmortem.py); without a writable temporary folder, its stack
        # at least goes to stderr.
        try:
            self.blackbox = postmortem.BlackBox(postmortem.run_folder(self.namespace), self.rank, self._proc)
        except OSError:
            self._faulthandler = not faulthandler.is_enabled()
            if self._faulthandler:
                faulthandler.enable()
        self.pipe.install()
        self.exchange.outgoing = self._record(Activity()).encode()
        self.exchange.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.pipe.wake()
        self.exchange.stop()
        if threading.get_ident() != self._thread.ident and self._thread.is_alive():
            self._thread.join(timeout=2 * self.limits.tick)
        self.pipe.restore()
        if self.blackbox is not None:
            self.blackbox.close()
            self.blackbox = None
        if self._faulthandler:
            faulthandler.disable()
        RECORDER.enabled = False
        RECORDER.abort = None
        RECORDER.on_mark = None

    def current_limits(self) -> Limits:
        """``timeout`` while the loops run; the long limit before (setup: a slow start is not a hang) and in
        :func:`~lightning_zero.faults.timeouts.extended` phases."""
        active = timeouts.ACTIVE
        if active is None:
            return self.limits.extended(self.long)
        if active.reason is not None:
            return self.limits.extended(active.current)
        return self.limits

    # ------------------------------------------------------------------ the thread
    @property
    def paused(self) -> float:
        """The seconds of this process's last pause, while it is recent ([Note: a pause, not a busy machine])."""
        if self._pause is None:
            return 0.0
        seconds, ended = self._pause
        return seconds if time.monotonic() - ended <= 2 * self.current_limits().stale_after else 0.0

    def _pause_since_tick(self, now: float) -> tuple[float, dict[int, float] | None]:
        """The time since the last tick if it was a pause, else 0.0; and every thread's scheduled seconds now.

        The watchdog thread's alone: it sleeps between ticks, so over a pause it gains next to nothing, and over a busy
        stretch it waits runnable for a core the whole overdue time. The sum over every thread of the process would
        also count the main thread's work and the other threads' waits just before the process was stopped, which on
        a loaded machine reached half the gap and hid a SIGSTOP as a busy machine; so each other thread counts alone,
        where one that ran for most of the gap held the interpreter's lock the watchdog waited for."""
        threads = thread_schedules()
        return paused_for(now - self._last_tick, self._last_threads, threads, self._thread_id, self.limits), threads

    def _run(self) -> None:
        self._thread_id = threading.get_native_id()
        self._last_tick, self._last_threads = time.monotonic(), thread_schedules()
        while not self._stop:
            try:
                ready, _, _ = select.select([self.pipe.read_fd], [], [], self.limits.tick)
            except (OSError, ValueError):
                ready = []
            if self._stop:
                return
            if ready:
                for number in self.pipe.drain():
                    if number in STOP_SIGNALS:
                        self._on_signal(number)
            now = time.monotonic()
            pause, threads = self._pause_since_tick(now)
            if pause:
                self._pause = (pause, now)
            self._last_tick, self._last_threads = now, threads
            try:
                self._tick(now)
            except Exception as error:  # noqa: BLE001 - never let the watchdog die silently
                print(f"[lightning_zero] rank {self.rank}: watchdog error: {error!r}", file=sys.stderr, flush=True)

    def _tick(self, now: float) -> None:
        sample = self._sample()
        me = self._record(sample)
        self.exchange.outgoing = me.encode()
        if self.stop_signal is not None:
            self._check_signal(now, sample)
        if self.decision is not None:
            first = self.exchange.snapshot.failure
            if first is not None and first.get("rank") != self.rank and self.decision.kind != "adopted":
                # Another rank's diagnosis was recorded first: every rank reports that one.
                self.decision = diagnosis.adopt(first, me, kind="adopted")
                RECORDER.abort = CollectiveError(f"[lightning_zero] {self.decision.text()}")
            if self._exit_at is not None and now >= self._exit_at and not self.failing:
                self._hard_exit(
                    f"its main thread did not stop within {self._grace:.0f} s of the diagnosis ({sample.describe()})", 1
                )
            return
        if self.failing or self.finishing:
            return
        peers = self.observe()
        limits = self.current_limits()
        snapshot = self.exchange.snapshot
        found = diagnosis.decide(
            me, peers, snapshot.failure, limits, self.context, self.mark_peer, self.exchange.silent(now)
        )
        if found is not None:
            self.abort(found)

    def _sample(self) -> Activity:
        seq = self._seq()
        sample = activity_mod.sample(self._main, RECORDER, seq)
        if sample.in_collective and sample.op is None:  # a wait outside collectives.py: time it here
            key = (sample.kind, seq)
            if self._blocked is None or self._blocked[0] != key:
                self._blocked = (key, time.monotonic())
            sample.blocked_for = time.monotonic() - self._blocked[1]
        elif not sample.in_collective:
            self._blocked = None
        return sample

    def _seq(self) -> int:
        try:
            return int(self.group._get_sequence_number_for_group()) if self.group is not None else 0
        except Exception:  # noqa: BLE001 - a destroyed group
            return 0

    def _record(self, sample: Activity) -> Record:
        self._beat += 1
        mark = RECORDER.last_mark()
        progress = (RECORDER.ops, sample.seq, mark)
        if progress != self._progress[0]:
            self._progress = (progress, time.monotonic())
        return Record(
            rank=self.rank,
            beat=self._beat,
            state=self.state,
            ops=RECORDER.ops,
            seq=sample.seq or self._seq(),
            phase=mark.phase if mark else None,
            batch=mark.batch if mark else None,
            activity=sample,
            marks=list(RECORDER.marks),
            recent=RECORDER.recent_ops()[-16:],
            steps={phase: count + 1 for phase, count in dict(RECORDER.counts).items()},
            proc=self._proc,
            paused=round(self.paused, 1),
            signal=self.stop_signal.name if self.stop_signal else None,
            error=self.error,
            stalled=round(time.monotonic() - self._progress[1], 1),
        )

    def observe(self) -> dict[int, Peer]:
        """The peers' records of the latest snapshot, aged by when their beat last changed."""
        snapshot = self.exchange.snapshot
        peers: dict[int, Peer] = {}
        for rank, raw in snapshot.records.items():
            try:
                record = Record.decode(raw)
            except (ValueError, TypeError, KeyError):
                continue
            state = liveness(record.proc) if record.state == RUNNING else "unknown"
            pid = local_pid(record.proc) if state == "alive" else None
            scheduled = None if pid is None else scheduled_seconds(pid)
            seen = self._seen.get(rank)
            if seen is None or seen[0] != record.beat:
                self._seen[rank] = seen = (record.beat, snapshot.taken_at, scheduled)
            age = max(0.0, snapshot.taken_at - seen[1])
            ran = None if scheduled is None or seen[2] is None else scheduled - seen[2]
            disk = None if pid is None else disk_io(pid)
            last_disk = self._disk.get(rank)
            if last_disk is None or last_disk[0] != disk:
                self._disk[rank] = last_disk = (disk, snapshot.taken_at)
            if disk is not None and age > 0 and snapshot.taken_at - last_disk[1] < age / 2 and last_disk[1] > seen[1]:
                ran = age  # still waiting on the disk: slow, not stopped or hung
            peers[rank] = Peer(record, age, state, ran)
        return self._with_black_boxes(peers)

    def _with_black_boxes(self, peers: dict[int, Peer]) -> dict[int, Peer]:
        """Peers on this host whose process is gone, as their flight files left them: fresher than their last
        record, and the only record when the store died with rank 0's process."""
        if self.blackbox is None:
            return peers
        for rank in postmortem.ranks_with_files(self.blackbox.folder):
            known = peers.get(rank)
            if rank == self.rank or (known is not None and known.liveness != "dead"):
                continue
            record = postmortem.read_record(self.blackbox.folder, rank)
            if record is not None and liveness(record.proc) == "dead":
                peers[rank] = Peer(record, known.age if known is not None else 0.0, "dead")
        return peers

    # ------------------------------------------------------------------ acting
    def abort(self, found: Diagnosis) -> None:
        """End the run with ``found``: tell the user, the peers and the main thread (see module docstring)."""
        if self.decision is not None:
            return
        self.decision = found
        text = found.text()
        print(f"[lightning_zero] rank {self.rank}: {text}", file=sys.stderr, flush=True)
        if self.exchange.snapshot.failure is None:
            self.exchange.failure_out = found.to_failure(self.rank)
            self.exchange.wake()
        RECORDER.abort = CollectiveError(f"[lightning_zero] {text}")
        self._grace = 2.0 if self.stop_signal is not None else self.current_limits().abort_grace
        self._exit_at = time.monotonic() + self._grace

    def _hard_exit(self, reason: str, code: int) -> None:
        print(f"[lightning_zero] rank {self.rank}: ending this process: {reason}.", file=sys.stderr, flush=True)
        self.exchange.flush(1.0)  # the failure and this rank's last record, if the store answers
        if self.blackbox is not None:
            self.blackbox.close()  # this exit is decided, not a crash: the peers have the failure already
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)

    def _on_signal(self, number: int) -> None:
        if self.stop_signal is not None:
            return
        self.stop_signal = StopSignal(number)
        print(
            f"[lightning_zero] rank {self.rank}: received {self.stop_signal.name}; the run stops at the next batch "
            f"boundary, and this process ends within {self.limits.sigterm_grace:.0f} s in any case.",
            file=sys.stderr,
            flush=True,
        )

    def _check_signal(self, now: float, sample: Activity) -> None:
        stop, limits = self.stop_signal, self.limits
        if stop is None:
            raise RuntimeError("lightning_zero internal error: called once a signal arrived; never reset")
        extended = timeouts.ACTIVE is not None and timeouts.ACTIVE.reason is not None  # e.g. a checkpoint being saved
        stall = limits.sigterm_grace if extended else limits.sigterm_stall
        why = stop.overdue(now, sample.in_collective, sample.blocked_for, stall, limits.sigterm_grace)
        if why is None:
            return
        summary = f"rank {self.rank} received {stop.name} and ended while {why}: {sample.describe()}"
        if self.decision is None and self.exchange.snapshot.failure is None:
            self.exchange.failure_out = Diagnosis("sigterm", self.rank, summary).to_failure(self.rank)
        self._hard_exit(summary, 128 + stop.number)

    # ------------------------------------------------------------------ main-thread entry points
    def on_exception(self, exception: BaseException) -> None:
        """Name the cause in ``exception`` and tell the peers (called from the strategy's ``on_exception``)."""
        self.failing = True
        if self.state == FAILED:
            return
        now = time.monotonic()
        # Stopped just now, before a tick saw it? The whole gap counts: the ranks that gave up on this one waited
        # ``stale_after`` from its last tick, so less would miss the pause whenever they ended within a tick.
        pause, _ = self._pause_since_tick(now)
        if pause:
            self._pause = (pause, now)
        seq = self._seq()
        where = activity_mod.from_exception(exception, RECORDER, seq)
        me = self._record(where)
        # Whether the store answered its last round trip: a slow one (a loaded host starves this thread) is still
        # worth the wait below, since the failure record it carries is what every rank's message names.
        healthy = self.exchange.error is None
        if isinstance(exception, CollectiveError):
            pass  # the diagnosis is its message
        elif self.decision is not None:
            failures.add_note(exception, me.placed(self.decision.text()))
        elif failures.is_communication_error(exception):
            # A rank that could not run (SIGSTOP, or a host stalling it) is the cause of what its peers recorded
            # about it meanwhile: say so first. A failure naming another rank (its own error) is not.
            paused = me.paused >= self.current_limits().stale_after
            first = self._first_failure(healthy, wait=self.limits.settle)
            if paused and first is not None and first.get("culprit") in (None, self.rank):
                first = None
            if first is not None:
                failures.brought_down_by(exception, first, self.rank)
                failures.add_note(exception, f"This rank ({self.rank}) was {me.where()}.")
            else:
                found = diagnosis.explain(me, self.observe(), self.current_limits(), self.context, str(exception))
                failures.add_note(exception, me.placed(found.text()))
                self.exchange.failure_out = found.to_failure(self.rank)
        else:  # this rank's own error: the cause, for everybody
            message = f"rank {self.rank} raised {failures.error_text(exception)} ({me.where()})"
            failure = {
                "rank": self.rank,
                "culprit": self.rank,
                "kind": "error",
                "message": message,
                "error": failures.error_text(exception),
            }
            first = self._first_failure(healthy)
            if first is not None:
                failures.brought_down_by(exception, first, self.rank)
            else:
                self.exchange.failure_out = failure
            waiting = "; ".join(
                f"rank {r} is {p.record.where()}"
                for r, p in sorted(self.observe().items())
                if p.record.activity.in_collective
            )
            print(
                f"[lightning_zero] {message}; the other ranks stop with it" + (f" ({waiting})." if waiting else "."),
                file=sys.stderr,
                flush=True,
            )
        self.state, self.error = FAILED, failures.error_text(exception)[:300]
        self.exchange.outgoing = self._record(where).encode()
        if healthy:  # the peers' sockets close when this process ends: they read the cause from the store
            self.exchange.flush(self.current_limits().stale_after)

    def _first_failure(self, healthy: bool, wait: float = 0.0) -> dict[str, Any] | None:
        """The run's first failure, waiting ``wait`` seconds for a peer that is writing it right now and, on a
        loaded host, until one round trip to the store began after this call (at most ``stale_after``)."""
        start, fresh = time.monotonic(), wait <= 0.0
        while True:
            first, waited = self.exchange.snapshot.failure, time.monotonic() - start
            if (
                first is not None
                or not healthy
                or self.exchange.error is not None
                or (waited >= wait and (fresh or waited >= self.limits.stale_after))
            ):
                return first
            fresh = self.exchange.flush(min(1.0, max(0.05, wait - waited))) or fresh

    def finish(self) -> CollectiveError | None:
        """The exit agreement (see module docstring): None when every rank finished, else the error to raise."""
        self.finishing = True
        self.state = FINISHED
        self.exchange.wanted = [r for r in range(self.world_size) if r != self.rank]
        self.exchange.outgoing = self._record(Activity(seq=self._seq())).encode()
        self.exchange.finishing = True
        self.exchange.wake()
        start = time.monotonic()
        cycle = self.exchange.snapshot.cycle
        while True:
            self.exchange.flush(self.limits.tick)
            if self.exchange.snapshot.cycle == cycle:
                if time.monotonic() - start >= self.limits.timeout:
                    return self._agreement_failed(
                        Diagnosis(
                            "store",
                            None,
                            f"rank {self.rank} finished but could not reach the store for "
                            f"{self.limits.timeout:g} s to learn whether the other ranks did ({self.exchange.error}).",
                        )
                    )
                continue
            cycle = self.exchange.snapshot.cycle
            if self.exchange.snapshot.finished < self.world_size:
                me = self._record(Activity(seq=self._seq()))
                outcome = diagnosis.exit_agreement(
                    me,
                    self.observe(),
                    self.exchange.snapshot.failure,
                    self.current_limits(),
                    self.context,
                    time.monotonic() - start,
                )
                if isinstance(outcome, Diagnosis):
                    return self._agreement_failed(outcome)
                if outcome is not True:
                    continue
            self.exchange.leave(self.rank == 0, self.limits.stale_after, self.limits.tick)
            return None

    def _agreement_failed(self, found: Diagnosis) -> CollectiveError:
        if self.exchange.snapshot.failure is None:  # before this rank's record says "failed" (see heartbeat_store.py)
            self.exchange.failure_out = found.to_failure(self.rank)
        self.state = FAILED
        self.error = found.summary[:300]
        print(f"[lightning_zero] rank {self.rank}: {found.text()}", file=sys.stderr, flush=True)
        self.exchange.outgoing = self._record(Activity(seq=self._seq())).encode()
        self.exchange.flush(2.0)
        return CollectiveError(f"[lightning_zero] {found.text()}")
