"""What a rank that died in native code was doing, read by its peers on the same host (see [Note: the flight
file] in ``engine/comm/flight_file.py``).

Each rank of a run keeps two files in the run's folder under the temporary directory: ``rank<R>.flight``, the
flight recorder's memory-mapped copy, and ``rank<R>.fatal``, where ``faulthandler`` writes the Python stack of
every thread if the process dies of a fatal signal (gloo's ``abort()``, a segmentation fault). A clean stop
removes both. A peer whose watchdog finds the process gone reads them into a :class:`Record` as fresh as the
moment of death: the collective it was in (kind, number, size), its last step marks, the signal and the user's
call site from the main thread's stack.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
import time
from pathlib import Path
from typing import IO

from lightning_zero.engine.comm.flight import RECORDER, Mark, Op, read_file
from lightning_zero.faults.activity import classify_frames, main_thread_frames
from lightning_zero.faults.heartbeat import RUNNING, Record, liveness

_COMM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "comm") + os.sep
#: faulthandler's first line names the fatal signal this way.
_SIGNALS = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
#: A crashed run's folder (every process in it gone) is kept this long for the user, then removed by a new run.
_KEEP_SECONDS = 24 * 3600


def run_folder(namespace: str) -> Path:
    """The folder shared by the ranks of one run on this host (the namespace is the same on every rank)."""
    return Path(tempfile.gettempdir()) / "lightning_zero-flight" / namespace.replace("/", "_")


class BlackBox:
    """This rank's two files, from the watchdog's start to its stop."""

    def __init__(self, folder: Path, rank: int, proc: str) -> None:
        self.folder = folder
        self.fatal_path = folder / f"rank{rank}.fatal"
        self._fatal: IO[str] | None = None
        _remove_old_runs(folder.parent)
        folder.mkdir(parents=True, exist_ok=True)
        RECORDER.write_to(folder / f"rank{rank}.flight", proc)
        if not faulthandler.is_enabled():  # someone else's (pytest's) handler stays as it is
            self._fatal = open(self.fatal_path, "w")
            faulthandler.enable(file=self._fatal, all_threads=True)

    def close(self) -> None:
        RECORDER.close_file()
        if self._fatal is not None:
            faulthandler.disable()
            self._fatal.close()
            self.fatal_path.unlink(missing_ok=True)
            self._fatal = None
        try:
            self.folder.rmdir()  # the last rank out removes the folder
        except OSError:
            pass


def _remove_old_runs(root: Path) -> None:
    if not root.is_dir():
        return
    cutoff = time.time() - _KEEP_SECONDS
    for folder in root.iterdir():
        try:
            if folder.stat().st_mtime < cutoff and all(_gone(path) for path in folder.glob("*.flight")):
                for path in folder.iterdir():
                    path.unlink()
                folder.rmdir()
        except OSError:
            pass


def _gone(flight: Path) -> bool:
    snapshot = read_file(flight)
    return snapshot is None or liveness(snapshot.proc) == "dead"


def ranks_with_files(folder: Path) -> list[int]:
    try:
        return sorted(int(p.stem[4:]) for p in folder.glob("rank*.flight") if p.stem[4:].isdigit())
    except OSError:
        return []


def read_record(folder: Path, rank: int) -> Record | None:
    """``rank``'s record as its flight file left it (None without one), with ``crash`` set when faulthandler wrote
    a fatal error: the signal, and the call site from the main thread's stack."""
    snapshot = read_file(folder / f"rank{rank}.flight")
    if snapshot is None:
        return None
    fatal = _read_text(folder / f"rank{rank}.fatal")
    frames = main_thread_frames(fatal, snapshot.main_ident)
    activity = classify_frames(frames)
    if snapshot.waiting is not None:
        activity.in_collective, activity.op, activity.kind = True, *snapshot.waiting
    if snapshot.recent:
        number, kind = snapshot.recent[-1][:2]
        activity.last = f"{kind} #{number}"
        if snapshot.waiting is None and _in_comm_layer(frames):
            # It died posting its last collective's transfers, before it began to wait: gloo aborts a process as
            # soon as a mismatched message arrives, which may be while the main thread still posts the ring.
            activity.in_collective, activity.op, activity.kind = True, number, kind
    marks = [Mark(*m) for m in snapshot.marks]
    last = marks[-1] if marks else None
    return Record(
        rank=rank,
        state=RUNNING,
        ops=snapshot.ops,
        phase=last.phase if last else None,
        batch=last.batch if last else None,
        activity=activity,
        marks=marks,
        steps=snapshot.steps,
        recent=[Op(*op) for op in snapshot.recent],
        proc=snapshot.proc,
        crash=_crash(fatal, folder / f"rank{rank}.fatal"),
    )


def _in_comm_layer(frames: list[tuple[str, int, str]]) -> bool:
    return any(os.path.abspath(filename).startswith(_COMM) for filename, _, _ in frames)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _crash(fatal: str, path: Path) -> str | None:
    first = next((line for line in fatal.splitlines() if line.startswith("Fatal Python error:")), None)
    if first is None:
        return None
    name = first.split(":", 1)[1].strip()
    return f"{_SIGNALS.get(name, name)}; its Python stack is in {path}"
