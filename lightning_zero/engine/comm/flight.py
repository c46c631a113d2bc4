"""The flight recorder: what this rank's main thread has communicated, cheap enough to stay always on.

Like torch's NCCL flight recorder, each rank keeps a short ring of its most recent collectives, but only those
``collectives.py`` issues plus step-boundary marks; the watchdog thread (``faults/watchdog.py``) reads and publishes it.
The main thread's share is a few attribute writes and one ``deque.append`` per collective
(``benchmarks/results/2026-12-07-docstring-figures.md``).

[Note: operation numbers and the running hash]
In a data-parallel run every rank issues the same sequence of collectives, so ``all_gather #412`` names the same
collective on every rank. ``digest`` folds (kind, elements, dtype) of each into a running hash; two ranks whose digests
differ at the same mark issued different collectives, which gloo may not notice (equal sizes pair silently) and NCCL
never does. The hash uses fixed codes, never Python's ``hash`` of strings, which differs between processes.

Stage 3's collectives also fold in the unit they serve (:func:`unit_code`): ranks that gather different units of one
size (experts, each rank gathering the ones its tokens reach) would pair them silently, each computing with the
other's parameters.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_zero.engine.comm import flight_file

_KIND_CODES = {
    "all_reduce": 1,
    "reduce_scatter": 2,
    "all_gather": 3,
    "broadcast": 4,
    "broadcast_object": 5,
    "all_gather_object": 6,
    "gather_object": 7,
    "barrier": 8,
    "all_gather_uncounted": 9,
    "all_to_all": 10,
}
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int16,
)
#: Keyed by an optional dtype: a collective of pickled objects has none (code 15, as any dtype not listed).
_DTYPE_CODES: dict[torch.dtype | None, int] = {dtype: i + 1 for i, dtype in enumerate(_DTYPES)}
_MASK = (1 << 61) - 1
RING = 32  # collectives kept per rank
MARKS = 8  # step marks kept per rank
_UNITS: dict[int, str] = {}


def unit_code(name: str) -> int:
    """See [Note: operation numbers and the running hash]."""
    code = zlib.crc32(name.encode()) or 1
    _UNITS[code] = name
    return code


def unit_name(code: int) -> str:
    return _UNITS.get(code, f"unit {code:08x}") if code else ""


class Op(NamedTuple):
    """One collective as every rank should have issued it."""

    number: int
    kind: str
    numel: int
    dtype: str
    unit: str = ""

    def describe(self) -> str:
        unit = f", {self.unit}" if self.unit else ""
        return f"{self.kind} #{self.number} ({self.numel} x {self.dtype}{unit})"


class Mark(NamedTuple):
    """The state at the start of one step."""

    phase: str
    count: int  # type: ignore[assignment]  # mypy rejects a field shadowing tuple.count; diagnosis reads it by name
    batch: int | None
    ops: int
    digest: int
    seq: int


class Waiting(NamedTuple):
    number: int
    kind: str
    since: float  # time.monotonic() when the wait began


class CollectiveError(RuntimeError):
    """A rank failed, died, diverged or is stuck; the same text is every rank's error."""


class FlightRecorder:
    """One per process (:data:`RECORDER`); ``collectives.py`` and the strategy write it, the watchdog reads it."""

    def __init__(self) -> None:
        self.enabled = False
        self.abort: CollectiveError | None = None
        self.main = threading.main_thread().ident
        self.file: flight_file.FlightFile | None = None  # see [Note: the flight file]
        self.reset(None)

    def reset(self, group: Any) -> None:
        """Called on the thread that runs the loops; ``group`` is read for its sequence number at marks."""
        self.main = threading.get_ident()
        self.group = group
        self.ops = 0
        self.digest = 0
        self.recent: deque[tuple[int, str, int, torch.dtype | None, int]] = deque(maxlen=RING)
        self.marks: deque[Mark] = deque(maxlen=MARKS)
        self.counts: dict[str, int] = {}
        self.waiting: Waiting | None = None
        self.abort = None
        #: Set by the timeouts manager, to apply the op timeout to groups created later.
        self.on_mark: Callable[[], None] | None = None

    # ------------------------------------------------------------------ hot path (main thread)
    def issue(self, kind: str, numel: int, dtype: torch.dtype | None, unit: int = 0) -> int:
        """Raise the watchdog's diagnosis if the run is over. Collectives of other threads (a background checkpoint
        writer) are not part of the main sequence: number 0."""
        if self.abort is not None:
            raise self.abort
        if not self.enabled or threading.get_ident() != self.main:
            return 0
        self.ops = number = self.ops + 1
        self.digest = (
            (self.digest * 1000003)
            ^ (numel << 8)
            ^ (_DTYPE_CODES.get(dtype, 15) << 4)
            ^ _KIND_CODES.get(kind, 10)
            ^ (unit << 28)
        ) & _MASK
        self.recent.append((number, kind, numel, dtype, unit))
        if self.file is not None:
            self.file.issue(number, kind, numel, dtype, unit, self.digest)
        return number

    def wait(self, number: int, kind: str) -> None:
        """A wait that raises leaves this set, so the error handler still knows which collective failed."""
        if number:
            self.waiting = Waiting(number, kind, time.monotonic())
            if self.file is not None:
                self.file.wait(number, kind)

    def done(self, number: int) -> None:
        if number:
            self.waiting = None
            if self.file is not None:
                self.file.wait(0, "")

    def mark(self, phase: str, batch: int | None) -> None:
        if self.abort is not None:
            raise self.abort
        if not self.enabled:
            return
        count = self.counts[phase] = self.counts.get(phase, -1) + 1
        seq = self.group._get_sequence_number_for_group() if self.group is not None else 0
        self.marks.append(Mark(phase, count, batch, self.ops, self.digest, seq))
        if self.file is not None:
            steps = {name: n + 1 for name, n in self.counts.items()}
            self.file.mark(phase, count, batch, self.ops, self.digest, seq, steps)
        if self.on_mark is not None:
            self.on_mark()

    # ------------------------------------------------------------------ the flight file (watchdog start and stop)
    def write_to(self, path: Path, proc: str) -> None:
        """See [Note: the flight file]."""
        self.close_file()
        self.file = flight_file.FlightFile(path, proc, self.main or 0, RING, MARKS, _KIND_CODES, _DTYPE_CODES)

    def close_file(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    # ------------------------------------------------------------------ readers (any thread)
    def recent_ops(self) -> list[Op]:
        """As a peer reads them from the flight file."""
        return [
            Op(n, kind, numel, str(dtype).replace("torch.", "") if dtype in _DTYPE_CODES else "?", unit_name(unit))
            for n, kind, numel, dtype, unit in list(self.recent)
        ]

    def last_mark(self) -> Mark | None:
        marks = list(self.marks)
        return marks[-1] if marks else None


RECORDER = FlightRecorder()


def read_file(path: Path) -> flight_file.FlightSnapshot | None:
    return flight_file.read(path, RING, MARKS, _KIND_CODES, _DTYPE_CODES, unit_name)
