"""The stage 1-2 reducer's record of each trainable parameter's gradient through one optimizer step (see
[Note: gradients are held as sums until finalized] in ``grad_sync.py``)."""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn

from lightning_zero.engine.stage12.layout import ParamShardSpec


class GradState(enum.Enum):
    """Where a parameter's gradient is in one optimizer step's life (see :class:`ParamGradient`)."""

    EMPTY = enum.auto()
    """Nothing reduced since the last step consumed it: stage 2 has no gradient; stage 1's is ``p.grad``'s rows
    as they are (local, unreduced)."""
    REDUCED = enum.auto()
    """The sum over ranks landed in this rank's rows (stage 2: the shard storage; stage 1: ``p.grad``)."""
    UNUSED = enum.auto()
    """Reduced, but no rank produced a gradient: it is None, as in plain PyTorch (the optimizer skips it)."""
    FINALIZED = enum.auto()
    """Averaged (and unscaled) for the step, in :attr:`ParamGradient.final`; sticks until the step consumes it."""


@dataclasses.dataclass(eq=False)
class ParamGradient:
    """The reducer's record of one trainable parameter, as FSDP2 keeps an ``FSDPParam`` per parameter."""

    index: int
    """Position in the layout (and in the reducer's parameter list)."""
    param: nn.Parameter
    spec: ParamShardSpec
    shard: torch.Tensor | None
    """Stage 2: this rank's rows of the gradient, a view of its bucket's shard storage."""
    state: GradState = GradState.EMPTY
    produced: bool = False
    """This rank produced a gradient for it since the last step (see ``_forget_gradients_no_rank_produced``)."""
    landed: bool = False
    """A reduction landed in its rows since the last step, so the next one of its bucket adds to them."""
    final: torch.Tensor | None = None
    staged: torch.Tensor | None = None
    """With ``offload_optimizer``: the host copy of the held sum as it stands, made when its reduction landed;
    None once a later backward changes the sum (or before any landed)."""
