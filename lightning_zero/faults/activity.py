"""What the main thread is doing, seen from another thread (faulthandler's dump of its frames) or from a traceback.

A thread blocked in C (a gloo wait, a CUDA sync) keeps its Python frames, so a sample tells whether the main
thread waits in a collective, which one, and the user's call site: the innermost frame outside the libraries
(torch, Lightning, transformers, the standard library, this package). ``via`` is the innermost library
frame that is not torch / Lightning / this package (e.g. ``transformers/generation/utils.py`` in
``generate``), which often explains why a collective was issued.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import IO, Any

from lightning_zero.engine.comm.flight import FlightRecorder

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # lightning_zero/
#: Longest first: site-packages lies inside the standard library's directory.
_PATHS = sysconfig.get_paths()
_LIBRARIES = tuple(
    sorted(
        {os.path.abspath(_PATHS[k]) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib") if _PATHS.get(k)},
        key=len,
        reverse=True,
    )
)
_FRAMEWORK = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torchmetrics")
#: Where torch.distributed blocks: the c10d entry points, and any ``wait`` inside torch.distributed.
_C10D = os.sep + os.path.join("torch", "distributed", "distributed_c10d.py")
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_CATEGORY: dict[str, str] = {}


def category(filename: str) -> str:
    """ "user", "ours" (this package), "framework" (torch, Lightning) or "library" (anything else installed)."""
    found = _CATEGORY.get(filename)
    if found is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_PACKAGE):
            found = "ours"
        elif filename.startswith("<") or path.startswith(_LIBRARIES):
            top = next((path[len(lib) :].split(os.sep, 1)[0] for lib in _LIBRARIES if path.startswith(lib)), "")
            found = "framework" if top in _FRAMEWORK else "library"
        else:
            found = "user"
        _CATEGORY[filename] = found
    return found


def _where(frame_info: tuple[str, int, str]) -> str:
    filename, line, function = frame_info
    parts = filename.split(os.sep)
    short = os.sep.join(parts[-2:]) if len(parts) > 1 else filename
    return f"{short}:{line} in {function}"


@dataclass
class Activity:
    """One sample of the main thread. ``op`` is the ``collectives.py`` number of the collective it waits in
    (None for torch.distributed calls made elsewhere, e.g. by Lightning); ``seq`` the world group's sequence
    number (every operation on it, from any caller)."""

    in_collective: bool = False
    kind: str | None = None
    op: int | None = None
    seq: int = 0
    blocked_for: float = 0.0  # seconds in this same wait, on this rank's clock
    site: str | None = None
    via: str | None = None
    last: str | None = None  # the last collective issued through collectives.py, e.g. "all_gather #15"

    def describe(self) -> str:
        if self.in_collective:
            what = f"{self.kind} #{self.op}" if self.op else f"torch.distributed.{self.kind}"
            text = f"waiting in {what} (world op {self.seq}) for {self.blocked_for:.0f} s"
        else:
            text = "not in a collective" + (f" (the last it issued: {self.last})" if self.last else "")
        if self.site:
            text += f", called from {self.site}"
        if self.via:
            text += f" via {self.via}"
        return text

    def same_wait(self, other: Activity | None) -> bool:
        return (
            other is not None
            and self.in_collective
            and other.in_collective
            and self.kind == other.kind
            and self.op == other.op
            and self.seq == other.seq
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Activity:
        return cls(**data) if data else cls()


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_DUMP: IO[bytes] | None = None


def main_thread_frames(dump: str, main_ident: int) -> list[tuple[str, int, str]]:
    """The main thread's frames, innermost first, from a faulthandler dump of every thread."""
    frames: list[tuple[str, int, str]] = []
    inside = False
    for line in dump.splitlines():
        if (thread := _THREAD.match(line)) is not None:
            inside = int(thread.group(1), 16) == main_ident
        elif inside and (frame := _FRAME.match(line)) is not None:
            frames.append((frame.group(1), int(frame.group(2)), frame.group(3)))
    return frames


def _frames_of(main_ident: int) -> list[tuple[str, int, str]]:
    """Another thread's frames, read by faulthandler in C. Walking that thread's ``sys._current_frames()`` frame by
    ``f_back`` makes frame objects for its live frames, and on CPython 3.11 that crashes the process now and then
    (SIGSEGV in the sampling thread, seen here while the main thread built a model: the crash of thread-sampling
    profilers, python/cpython#111363); faulthandler reads the frames without making objects."""
    global _DUMP
    if _DUMP is None:
        _DUMP = tempfile.TemporaryFile()
    _DUMP.seek(0)
    _DUMP.truncate()
    faulthandler.dump_traceback(_DUMP, all_threads=True)
    _DUMP.seek(0)
    return main_thread_frames(_DUMP.read().decode(errors="replace"), main_ident)


def _traceback_frames(tb: TracebackType | None) -> list[tuple[str, int, str]]:
    out = []
    while tb is not None:
        out.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return out[::-1]


def classify(frames: list[tuple[str, int, str]], recorder: FlightRecorder, seq: int) -> Activity:
    """An :class:`Activity` from frames (innermost first) and the recorder's wait."""
    activity = Activity(seq=seq)
    recent = recorder.recent
    if recent:
        number, kind = recent[-1][:2]
        activity.last = f"{kind} #{number}"
    waiting = recorder.waiting
    if waiting is not None:
        activity.in_collective, activity.kind, activity.op = True, waiting.kind, waiting.number
        activity.blocked_for = time.monotonic() - waiting.since
    elif frames:
        filename, _, function = frames[0]
        if filename.endswith(_C10D) or (_DISTRIBUTED in filename and "wait" in function):
            activity.in_collective, activity.kind = True, function
    activity.site, activity.via = _site_and_via(frames)
    return activity


def classify_frames(frames: list[tuple[str, int, str]]) -> Activity:
    """An :class:`Activity` with only the call site, from frames (innermost first) of another process."""
    activity = Activity()
    activity.site, activity.via = _site_and_via(frames)
    return activity


def _site_and_via(frames: list[tuple[str, int, str]]) -> tuple[str | None, str | None]:
    """The innermost user frame, and the innermost library frame inside it (or a ``save_checkpoint`` of Lightning's
    or this package's: a save is collective, and a save on some ranks only is a common way to part them)."""
    via = None
    for info in frames:
        kind = category(info[0])
        if kind == "user":
            return _where(info), via
        if via is None and (kind == "library" or info[2] == "save_checkpoint"):
            via = _where(info)
    return None, via


def sample(main_ident: int, recorder: FlightRecorder, seq: int) -> Activity:
    """The main thread now (call from another thread)."""
    return classify(_frames_of(main_ident), recorder, seq)


def from_exception(exception: BaseException, recorder: FlightRecorder, seq: int) -> Activity:
    """Where the main thread was when ``exception`` was raised (the wait it raised from, if any)."""
    return classify(_traceback_frames(exception.__traceback__), recorder, seq)
