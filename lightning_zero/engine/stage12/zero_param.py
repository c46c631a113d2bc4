"""One object per trainable parameter at stages 1-2, as FSDP2 keeps an ``FSDPParam``: where its rows are (its spec in
the layout), its gradient through one optimizer step (see [Note: gradients are held as sums until finalized] in
``grad_sync.py``), its master where the optimizer steps one (``engine/offload/masters.py``), and the contract's record
of it (staged, landed, finalized, master: [Note: vocabulary] in ``engine/__init__.py``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch
from torch import nn

from lightning_zero.engine.api import ShardRecord
from lightning_zero.engine.offload.masters import Master
from lightning_zero.engine.shard import local_rows
from lightning_zero.engine.stage12.layout import ParamShardSpec


class GradState(enum.Enum):
    """Where a parameter's gradient is in one optimizer step's life."""

    EMPTY = enum.auto()
    """Stage 1's gradient is ``p.grad``'s rows as they are, local and unreduced."""
    REDUCED = enum.auto()
    UNUSED = enum.auto()
    """No rank produced a gradient: it is None, as in plain PyTorch, so the optimizer skips it."""
    FINALIZED = enum.auto()
    """Sticks until the step consumes it."""


@dataclasses.dataclass(eq=False)
class ZeroParam:
    """One trainable parameter this rank holds at stages 1-2."""

    index: int
    """Its place among the engine's trainable parameters (layout order)."""
    param: nn.Parameter
    spec: ParamShardSpec
    """Its rows and its place in a bucket (``layout.py``)."""
    rank: int
    master: Master | None = None
    """The rows the optimizer steps, where they are not a view of the parameter (mixed precision, offload)."""
    record: ShardRecord | None = None
    """What the contract shows of it (``engine/api.py``); set by the engine."""
    shard: torch.Tensor | None = None
    """Stage 2: a view of its bucket's shard storage (``grad_bucket.py``)."""
    state: GradState = GradState.EMPTY
    produced: bool = False
    """See ``_forget_gradients_no_rank_produced``."""
    landed: bool = False
    """The next reduction of its bucket adds to its rows."""
    final: torch.Tensor | None = None
    own_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """Stage 1: ``(p.grad, this rank's rows of it)``, kept so that the later reads in a step (clipping's norm,
    finalizing, the step) make no view; stale once ``p.grad`` is another tensor."""
    staged: torch.Tensor | None = None
    """With ``offload_optimizer``: the host copy of the held sum; None once a later backward changes the sum."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def on_host(self) -> bool:
        """Its master (and so its optimizer state) lives in host memory."""
        return self.master is not None and self.master.on_host

    def resident_rows(self) -> torch.Tensor:
        """This rank's rows of the parameter forward computes with (a view)."""
        return local_rows(self.param.detach(), self.rank, self.spec.world_size)

    def optimizer_rows(self) -> torch.Tensor:
        """This rank's rows as the optimizer updates them: its master, or a view of the parameter."""
        return self.master.tensor if self.master is not None else self.resident_rows()


def produced_flags(records: Sequence[ZeroParam]) -> torch.Tensor:
    return torch.tensor([r.produced for r in records], dtype=torch.int32)


def finalize_landed(records: Sequence[ZeroParam], ranks: int) -> tuple[list[torch.Tensor], float] | None:
    """What ``GradientReducer.finalize`` does, for a part stepping during backward (see
    [Note: the host step during backward] in ``engine/offload/schedule.py``); the worker averages by the coefficient
    returned once the copies have landed. None where a parameter produced no gradient on this rank, since whether
    another rank did is known only when backward ends."""
    if not all(r.produced and r.state is GradState.REDUCED and r.staged is not None for r in records):
        return None
    grads: list[torch.Tensor] = []
    for record in records:
        if record.staged is not None:  # for the type checker
            record.state, record.final = GradState.FINALIZED, record.staged
            grads.append(record.staged)
    return grads, 1.0 / ranks
