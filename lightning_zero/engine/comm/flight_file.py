"""The flight recorder's copy in a small memory-mapped file, for the ranks that outlive this process.

[Note: the flight file]
gloo ends a process whose collective does not match its peer's with ``abort()`` from one of its own threads
(``op.preamble.length <= op.nbytes ... Is there a distributed collective mismatch in your code?``): no Python code runs
after that, so the watchdog cannot publish what the main thread was doing, and its last published record is typically
from before the divergence. The recorder therefore also writes each collective, wait and step mark into a fixed-layout
file (``struct.pack_into`` on an ``mmap``, whose pages the kernel keeps when the process dies). A peer on the same host
that sees the process gone reads it back (:func:`read`) and, with the Python stack ``faulthandler`` wrote beside it,
names the collective and the call site the rank died in.

Layout (little-endian): a header, then a ring of ``RING`` collectives and a ring of ``MARKS`` step marks, each slot
chosen by its number modulo the ring's length.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

_MAGIC, _VERSION = b"LZFR", 2
_HEAD = struct.Struct("<4sI128sQ")  # magic, version, process identity, main thread ident
_COUNTERS = struct.Struct("<QQ")  # collectives issued, running hash
_WAITING = struct.Struct("<QI")  # the collective waited in (0: none), its kind code
_MARK_COUNT = struct.Struct("<Q")
_STEPS = struct.Struct("<4Q")  # steps begun per phase, in PHASES order
_OP = struct.Struct("<QQIII")  # number, elements, kind code, dtype code, stage-3 unit code
_MARK = struct.Struct("<IIqQQQ")  # phase code, step count, batch (-1: none), collectives, hash, world sequence

_COUNTERS_AT = _HEAD.size
_WAITING_AT = _COUNTERS_AT + _COUNTERS.size
_MARK_COUNT_AT = _WAITING_AT + _WAITING.size + 4
_STEPS_AT = _MARK_COUNT_AT + _MARK_COUNT.size
_RING_AT = _STEPS_AT + _STEPS.size

PHASES = ("train", "val", "test", "predict")


@dataclass
class FlightSnapshot:
    """``recent``: (number, kind, elements, dtype name, unit name), oldest first; ``marks``: (phase, count, batch, ops,
    digest, seq), oldest first."""

    proc: str
    main_ident: int
    ops: int
    digest: int
    waiting: tuple[int, str] | None
    recent: list[tuple[int, str, int, str, str]] = field(default_factory=list)
    marks: list[tuple[str, int, int | None, int, int, int]] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)


class FlightFile:
    def __init__(
        self,
        path: Path,
        proc: str,
        main_ident: int,
        ring: int,
        marks: int,
        kinds: dict[str, int],
        dtypes: dict[torch.dtype | None, int],
    ) -> None:
        self.path = path
        self.ring, self.mark_slots = ring, marks
        self._kinds, self._dtypes = kinds, dtypes
        self._marks_at = _RING_AT + ring * _OP.size
        size = self._marks_at + marks * _MARK.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEAD.pack_into(self._map, 0, _MAGIC, _VERSION, proc.encode()[:128], main_ident)
        self._marks_written = 0

    def issue(self, number: int, kind: str, numel: int, dtype: torch.dtype | None, unit: int, digest: int) -> None:
        _OP.pack_into(
            self._map,
            _RING_AT + (number % self.ring) * _OP.size,
            number,
            numel,
            self._kinds.get(kind, 0),
            self._dtypes.get(dtype, 0),
            unit,
        )
        _COUNTERS.pack_into(self._map, _COUNTERS_AT, number, digest)

    def wait(self, number: int, kind: str) -> None:
        _WAITING.pack_into(self._map, _WAITING_AT, number, self._kinds.get(kind, 0))

    def mark(
        self, phase: str, count: int, batch: int | None, ops: int, digest: int, seq: int, steps: dict[str, int]
    ) -> None:
        slot = self._marks_at + (self._marks_written % self.mark_slots) * _MARK.size
        code = PHASES.index(phase) + 1 if phase in PHASES else 0
        _MARK.pack_into(self._map, slot, code, count, -1 if batch is None else batch, ops, digest, seq)
        self._marks_written += 1
        _MARK_COUNT.pack_into(self._map, _MARK_COUNT_AT, self._marks_written)
        _STEPS.pack_into(self._map, _STEPS_AT, *(steps.get(p, 0) for p in PHASES))

    def close(self, remove: bool = True) -> None:
        self._map.close()
        if remove:
            self.path.unlink(missing_ok=True)


def read(
    path: Path,
    ring: int,
    marks: int,
    kinds: dict[str, int],
    dtypes: dict[torch.dtype | None, int],
    unit_name: Callable[[int], str],
) -> FlightSnapshot | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    marks_at = _RING_AT + ring * _OP.size
    if len(data) < marks_at + marks * _MARK.size:
        return None
    magic, version, proc, main_ident = _HEAD.unpack_from(data, 0)
    if magic != _MAGIC or version != _VERSION:
        return None
    kind_names = {code: name for name, code in kinds.items()}
    dtype_names = {code: str(dtype).replace("torch.", "") for dtype, code in dtypes.items()}
    ops, digest = _COUNTERS.unpack_from(data, _COUNTERS_AT)
    waiting_number, waiting_kind = _WAITING.unpack_from(data, _WAITING_AT)
    recent = []
    for slot in range(ring):
        number, numel, kind, dtype, unit = _OP.unpack_from(data, _RING_AT + slot * _OP.size)
        if number and number > ops - ring:
            recent.append(
                (number, kind_names.get(kind, "collective"), numel, dtype_names.get(dtype, "?"), unit_name(unit))
            )
    (written,) = _MARK_COUNT.unpack_from(data, _MARK_COUNT_AT)
    marks_out = []
    for index in range(max(0, written - marks), written):
        code, count, batch, mark_ops, mark_digest, seq = _MARK.unpack_from(
            data, marks_at + (index % marks) * _MARK.size
        )
        marks_out.append(
            (PHASES[code - 1] if code else "?", count, None if batch < 0 else batch, mark_ops, mark_digest, seq)
        )
    steps = dict(zip(PHASES, _STEPS.unpack_from(data, _STEPS_AT)))
    return FlightSnapshot(
        proc=proc.rstrip(b"\0").decode(errors="replace"),
        main_ident=main_ident,
        ops=ops,
        digest=digest,
        waiting=(waiting_number, kind_names.get(waiting_kind, "collective")) if waiting_number else None,
        recent=sorted(recent),
        marks=marks_out,
        steps={p: n for p, n in steps.items() if n},
    )
