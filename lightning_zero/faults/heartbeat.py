"""The heartbeat record each rank publishes in the store, and what an observer makes of it.

A record carries no timestamps: staleness is judged by the observer, as the time (on its own monotonic clock)
since the record's ``beat`` last changed, so clocks of different nodes never meet. ``proc`` identifies the
process (host, pid namespace, pid, start time) so that a peer on the same host can tell at once whether it
still exists, is stopped, or is a zombie; on another host only staleness tells.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field

from lightning_zero.engine.comm.flight import Mark, Op
from lightning_zero.faults.activity import Activity

RUNNING, FINISHED, FAILED = "running", "finished", "failed"


@dataclass
class Record:
    rank: int
    beat: int = 0
    state: str = RUNNING
    ops: int = 0
    seq: int = 0
    phase: str | None = None  # of the last mark: "train", "val", ...
    batch: int | None = None
    activity: Activity = field(default_factory=Activity)
    marks: list[Mark] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # steps run so far, by phase
    recent: list[Op] = field(default_factory=list)
    proc: str = ""
    paused: float = 0.0  # a recent stretch this process could not run at all (SIGSTOP, swapping): see watchdog.py
    stalled: float = 0.0  # seconds without progress (no collective issued, no step begun): NCCL never blocks the CPU
    signal: str | None = None  # "SIGTERM" once received
    error: str | None = None  # short, when failed
    crash: str | None = None  # the fatal signal, when the process died in native code (read from its black box)

    def encode(self) -> bytes:
        data = dict(self.__dict__)
        data["activity"] = self.activity.to_json()
        data["marks"] = [list(m) for m in self.marks]
        data["recent"] = [list(o) for o in self.recent]
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Record:
        data = json.loads(raw)
        data["activity"] = Activity.from_json(data.get("activity"))
        data["marks"] = [Mark(*m) for m in data.get("marks", [])]
        data["recent"] = [Op(*o) for o in data.get("recent", [])]
        return cls(**data)

    def steps_in(self, phase: str | None) -> int:
        return self.steps.get(phase, 0) if phase else 0

    def where(self) -> str:
        """``in training batch 3, waiting in all_gather #12 ...``: the step and what the main thread does there."""
        step = step_name(self.phase, self.batch)
        return f"{'in ' if self.phase else ''}{step}, {self.activity.describe()}"

    def placed(self, text: str) -> str:
        """``text``, followed by where this rank was, unless the text already speaks of this rank."""
        return text if "this rank" in text.lower() else f"{text}\nThis rank ({self.rank}) was {self.where()}."


_PHASES = {"train": "training", "val": "validation", "test": "test", "predict": "prediction"}


def phase_name(phase: str | None) -> str:
    return _PHASES.get(phase, phase) if phase else ""


def step_name(phase: str | None, batch: int | None) -> str:
    if phase is None:
        return "before the first step"
    name = phase_name(phase)
    return f"{name} batch {batch}" if batch is not None else f"{name} step"


@dataclass
class Peer:
    """A peer's latest record as this rank observed it: ``age`` is the seconds since its beat last changed."""

    record: Record
    age: float
    liveness: str = "unknown"  # "alive", "stopped", "dead" or "unknown" (another host)
    ran: float | None = None  # seconds its process ran or waited runnable during ``age`` (this host only)

    def silent(self, after: float) -> bool:
        """No heartbeat for ``after`` seconds, and not because its process is busy or waits for a core on a loaded
        machine (``watchdog.py``, [Note: a pause, not a busy machine])."""
        return self.age >= after and (self.ran is None or self.ran < self.age / 2)


def this_process() -> str:
    pid = os.getpid()
    return "|".join((socket.gethostname(), _pid_namespace(), str(pid), _start_time(pid) or ""))


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # fields after the command name, from "state" on


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def disk_io(pid: int | str = "self") -> tuple[int, int, int] | None:
    """A process's major page faults and bytes read from and written to storage so far (``/proc/PID/stat``,
    ``/proc/PID/io``): what it waited for from the disk, asleep but neither stopped nor hung, as a process loading its
    libraries or writing a checkpoint does where the page cache keeps little (``free`` shows none cached on this
    project's CI machines, whose imports then wait seconds for the disk). None where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            faults = int(f.read().rsplit(")", 1)[1].split()[9])  # majflt, the 12th field
        with open(f"/proc/{pid}/io") as f:
            counts = dict(line.split(":") for line in f)
        return faults, int(counts["read_bytes"]), int(counts["write_bytes"])
    except (OSError, IndexError, ValueError, KeyError):
        return None


def thread_schedules(pid: int | str = "self") -> dict[int, float] | None:
    """Each thread's :func:`scheduled_seconds`, by thread id (a thread just started may read 0); None where the kernel
    does not say."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    nanoseconds = {int(name): _schedstat(pid, name) for name in tasks}
    found = {task: value / 1e9 for task, value in nanoseconds.items() if value is not None}
    return found if any(found.values()) else None


def scheduled_seconds(pid: int | str = "self", task: int | None = None) -> float | None:
    """Seconds the threads of a process (``task``: that one thread of it) have spent on a CPU or runnable in a run
    queue waiting for one (the first two fields of ``/proc/PID/task/*/schedstat``); None where the kernel does not
    say (no such file, or a kernel built without scheduler statistics, whose files read all zeros: a live process has
    always run).

    What tells a process that could not run (stopped by SIGSTOP or a debugger, or waiting for its pages to be
    swapped in: neither counts) from one that was merely not scheduled on a busy machine (runnable: it counts),
    where the time between two of its watchdog's ticks looks the same."""
    try:
        tasks = [str(task)] if task is not None else os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    times = [value for value in (_schedstat(pid, name) for name in tasks) if value is not None]
    total = sum(times)
    return total / 1e9 if times and total > 0 else None


def _schedstat(pid: int | str, task: int | str) -> int | None:
    """A thread's nanoseconds on a CPU and runnable in a run queue; None for a thread that ended meanwhile."""
    try:
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) + int(waiting)


def local_pid(proc: str) -> int | None:
    """The pid of the process a record came from, when it is on this host and in this pid namespace (a pid
    elsewhere means another process)."""
    try:
        host, namespace, pid, _ = proc.split("|")
    except ValueError:
        return None
    if host != socket.gethostname() or namespace != _pid_namespace() or not namespace:
        return None
    return int(pid)


def liveness(proc: str) -> str:
    """Whether the process a record came from still runs: only answerable on the same host and pid namespace;
    the start time guards against a reused pid."""
    pid = local_pid(proc)
    if pid is None:
        return "unknown"
    start = proc.rsplit("|", 1)[1]
    fields = _stat(pid)
    if fields is None or (start and len(fields) > 19 and fields[19] != start):
        return "dead"
    if fields[0] in ("Z", "X"):
        return "dead"
    return "stopped" if fields[0] in ("T", "t") else "alive"
