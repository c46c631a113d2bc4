"""The stage 1-2 reducer's record of each trainable parameter's gradient through one optimizer step (see
[Note: gradients are held as sums until finalized] in ``grad_sync.py``; staged, landed, finalized: [Note: vocabulary]
in ``engine/__init__.py``), and the flags of which of them any rank
produced a gradient for; which of them a part stepping during backward may take as final."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

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
    own_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """Stage 1: ``(p.grad, this rank's rows of it)``, the view made at the first read of the held sum in a step, so
    that the later ones (clipping's norm, finalizing, the step) make none; stale once ``p.grad`` is another tensor."""
    staged: torch.Tensor | None = None
    """With ``offload_optimizer``: the host copy of the held sum as it stands, made when its reduction landed;
    None once a later backward changes the sum (or before any landed)."""


def produced_flags(records: Sequence[ParamGradient]) -> torch.Tensor:
    """This rank's :class:`~lightning_zero.engine.comm.used_flags.UsedFlags`: 1 where it produced a gradient."""
    return torch.tensor([r.produced for r in records], dtype=torch.int32)


def finalize_landed(records: Sequence[ParamGradient], ranks: int) -> tuple[list[torch.Tensor], float] | None:
    """What ``GradientReducer.finalize`` does to these records, for a part stepping during backward (see [Note: the
    host step during backward] in ``engine/host_steps.py``): their host copies become the final gradients, to be
    averaged over ``ranks`` by the coefficient returned (in the worker, once the copies have landed); ``finalize``
    then leaves them alone. None, with nothing changed, where a parameter produced
    no gradient on this rank or has no host copy."""
    if not all(r.produced and r.state is GradState.REDUCED and r.staged is not None for r in records):
        return None
    grads: list[torch.Tensor] = []
    for record in records:
        if record.staged is not None:  # checked above; for the type checker
            record.state, record.final = GradState.FINALIZED, record.staged
            grads.append(record.staged)
    return grads, 1.0 / ranks
