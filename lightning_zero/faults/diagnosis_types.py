"""What the watchdog's decisions are made of: the limits (every duration, from ``timeout``), the run's context,
the :class:`Diagnosis` that ends a run, and the hints two kinds of decisions share. Shared by ``diagnosis.py`` (the
decisions) and ``divergence.py`` (silent divergence)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_zero.faults.heartbeat import Record

EVAL_PHASES = ("val", "test", "predict")


@dataclass(frozen=True)
class Limits:
    """Every duration the watchdog uses, derived from ``timeout`` (seconds)."""

    timeout: float
    tick: float = 1.0
    margin: float = 2.0  # the process-group timeout is timeout + margin: the watchdog's diagnosis comes first
    stale_after: float = 4.0  # no heartbeat for this long while someone waits: that rank is stopped or lost
    settle: float = 3.0  # a state must hold this long before it counts (ranks finish a few ms apart)
    sigterm_grace: float = 25.0  # after SIGTERM the process ends by then, whatever the main thread does
    sigterm_stall: float = 5.0  # ... and sooner if it waits in one collective this long after SIGTERM

    @classmethod
    def for_timeout(cls, seconds: float) -> Limits:
        return cls(
            timeout=seconds,
            tick=min(1.0, max(0.25, seconds / 8)),
            margin=min(10.0, max(2.0, seconds / 4)),
            stale_after=min(15.0, max(4.0, seconds / 2)),
            settle=min(3.0, max(1.0, seconds / 4)),
            sigterm_stall=min(5.0, seconds),
        )

    @property
    def pg_timeout(self) -> float:
        return self.timeout + self.margin

    @property
    def abort_grace(self) -> float:
        """After a decision, how long the main thread has to raise by itself before the process is ended."""
        return self.margin

    def extended(self, seconds: float) -> Limits:
        """For a known one-sided phase (``faults.extended``): waits and silences up to ``seconds`` are fine."""
        return dataclasses.replace(self, timeout=max(self.timeout, seconds), stale_after=max(self.stale_after, seconds))


@dataclass(frozen=True)
class Context:
    """What the strategy knows about the run."""

    world_size: int
    symmetric: bool = True  # every rank issues the same collectives (False under pipeline stages)
    generate_hint: bool = False  # stage 3 and the module holds a Hugging Face model with generate()
    places: tuple[str, ...] = ()  # per rank, what it runs under pipeline stages ("pipeline stage 1 of replica 0")

    def placed(self, text: str) -> str:
        """``text`` with each rank it names followed, once, by what that rank runs (under pipeline stages)."""
        if not self.places:
            return text
        seen: set[int] = set()

        def name(match: re.Match) -> str:
            rank = int(match.group(1))
            if rank in seen or rank >= len(self.places):
                return match.group(0)
            seen.add(rank)
            return f"{match.group(0)} ({self.places[rank]})"

        return re.sub(r"\b[Rr]ank (\d+)\b(?! \(pipeline)", name, text)


@dataclass(frozen=True)
class Diagnosis:
    kind: str  # failed, died, crashed, diverged, finished, stale, store, stuck, sigterm, error
    culprit: int | None
    summary: str
    hint: str = ""

    def text(self) -> str:
        return f"{self.summary}\n{self.hint}" if self.hint else self.summary

    def to_failure(self, reporter: int) -> dict[str, Any]:
        return {"rank": reporter, "culprit": self.culprit, "kind": self.kind, "message": self.text()}


MISMATCH_HINT = (
    "Every rank must issue the same collectives in the same order. Under stage 3 each forward of a sharded module "
    "gathers its parameters with a collective, so a module called on some ranks only (e.g. generating samples on "
    "rank 0 in `validation_step`) desynchronises them: run it on every rank and keep rank 0's result, or run it on "
    "an unsharded copy after `fit` (`lightning_zero.load_from_checkpoint`). A module each rank picks by its data "
    "does the same when it is a unit of its own (an expert of a mixture): keep it inside a unit every rank runs "
    "(`wrap_policy` naming the block that holds the experts). A `self.log(..., sync_dist=True)` or a "
    "torch.distributed call under a rank condition does the same."
)


GENERATE_HINT = (
    "Under stage 3 every forward pass gathers parameters with collectives, so Hugging Face `generate()` must run "
    "the same number of forward passes on every rank: pass `synced_gpus=True` to `generate()` (transformers "
    "turns it on by itself for FSDP-managed models unless `synced_gpus=False` is passed)."
)


SAVE_HINT = (
    "`Trainer.save_checkpoint` is collective under ZeroStrategy: every rank writes its own shards (and a full "
    "checkpoint is gathered on every rank first), so call it on every rank, not under `if trainer.is_global_zero:`; "
    "Lightning writes the single file from rank 0 by itself."
)


def saving_involved(records: Iterable[Record]) -> bool:
    return any("in save_checkpoint" in (r.activity.via or "") for r in records)


def generate_involved(phase: str | None, records: Iterable[Record], context: Context) -> bool:
    if any("generation" in (r.activity.via or "") for r in records):
        return True
    return context.generate_hint and phase in EVAL_PHASES
