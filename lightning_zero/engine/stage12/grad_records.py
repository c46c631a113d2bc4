"""The stage 1-2 reducer's record of each trainable parameter's gradient through one optimizer step (see
[Note: gradients are held as sums until finalized] in ``grad_sync.py``; staged, landed, finalized: [Note: vocabulary]
in ``engine/__init__.py``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch
from torch import nn

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
class ParamGradient:
    """The reducer's record of one trainable parameter, as FSDP2 keeps an ``FSDPParam`` per parameter."""

    index: int
    param: nn.Parameter
    spec: ParamShardSpec
    shard: torch.Tensor | None
    """Stage 2: a view of its bucket's shard storage."""
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


def produced_flags(records: Sequence[ParamGradient]) -> torch.Tensor:
    return torch.tensor([r.produced for r in records], dtype=torch.int32)


def finalize_landed(records: Sequence[ParamGradient], ranks: int) -> tuple[list[torch.Tensor], float] | None:
    """What ``GradientReducer.finalize`` does, for a part stepping during backward (see
    [Note: the host step during backward] in ``engine/offload/schedule.py``); the worker averages by the coefficient returned
    once the copies have landed. None where a parameter produced no gradient on this rank, since whether another rank
    did is known only when backward ends."""
    if not all(r.produced and r.state is GradState.REDUCED and r.staged is not None for r in records):
        return None
    grads: list[torch.Tensor] = []
    for record in records:
        if record.staged is not None:  # for the type checker
            record.state, record.final = GradState.FINALIZED, record.staged
            grads.append(record.staged)
    return grads, 1.0 / ranks
