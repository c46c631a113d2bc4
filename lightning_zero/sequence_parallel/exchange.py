"""The all-to-all that trades attention heads for positions inside a sequence-parallel group, with its gradient.

Before attention each rank holds all heads of its ``T / k`` positions; after :func:`heads_for_positions` it holds
``H / k`` heads of all ``T`` positions, so attention sees the whole sequence. :func:`positions_for_heads` is the way
back. Each is the other's gradient, so autograd sends the gradients back through the same exchange. The collective is
the engine's (``collectives.all_to_all``), so the flight recorder and the fault diagnosis see it like any other.

Without a group (the planner's trace of one rank, ``planning/trace.py``) the exchange keeps the shapes and the
allocations of the real one, with this rank's own chunk in place of the others': the bytes are right, the numbers are
not, which a trace of fake tensors never reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives


def _exchange(
    tensor: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup | None, size: int
) -> torch.Tensor:
    """Chunk ``j`` of ``tensor`` along ``scatter_dim`` goes to rank ``j``; the chunks received, in rank order, are
    concatenated along ``gather_dim``."""
    chunks = tensor.chunk(size, dim=scatter_dim)
    if group is None:  # a trace: the shapes and allocations only
        sent = torch.stack([chunks[0]] * size)
        received = sent.clone()
    else:
        sent = torch.stack(chunks).contiguous()  # (k, *chunk): chunk j first-dim j, as all_to_all_single splits
        received = torch.empty_like(sent)
        collectives.all_to_all(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _SequenceExchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup | None, size: int
    ) -> torch.Tensor:
        ctx.dims, ctx.group, ctx.size = (scatter_dim, gather_dim), group, size
        return _exchange(tensor, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group, ctx.size), None, None, None, None


def heads_for_positions(
    tensor: torch.Tensor, head_dim: int, seq_dim: int, group: dist.ProcessGroup | None, size: int
) -> torch.Tensor:
    """All heads of this rank's positions -> this rank's ``H / k`` heads of every position."""
    return _SequenceExchange.apply(tensor, head_dim, seq_dim, group, size)


def positions_for_heads(
    tensor: torch.Tensor, head_dim: int, seq_dim: int, group: dist.ProcessGroup | None, size: int
) -> torch.Tensor:
    """This rank's heads of every position -> every head of this rank's positions."""
    return _SequenceExchange.apply(tensor, seq_dim, head_dim, group, size)


class _GroupSum(torch.autograd.Function):
    """The sum over the group; its gradient is the sum of the group's gradients (each rank's loss is the group's).
    Without a group (a trace) the tensor itself."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return collectives.all_reduce(tensor.clone(), group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return collectives.all_reduce(grad.contiguous().clone(), group=ctx.group), None


def group_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return tensor if group is None else _GroupSum.apply(tensor, group)
