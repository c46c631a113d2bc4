"""Gradients of trainable parameters that no optimizer steps, handed over whole, as DDP leaves them.

[Note: parameters no optimizer steps]
A trainable parameter left out of every optimizer (updated by a rule of the user's own, say) is reduced with the others,
but no step finalizes or consumes its sums: stage 1 would leave this rank's rows of ``p.grad`` holding the sum over
ranks and zeros elsewhere, stage 2 no ``p.grad`` at all, and the held sums would grow window after window. DDP leaves
such a parameter the averaged full gradient in ``p.grad``, where it accumulates until the user clears it, since
Lightning's ``zero_grad`` clears only an optimizer's parameters. So does this, at the end of every synchronising
backward: the held sums are averaged, gathered whole into ``p.grad`` and released, and the next window's reduction adds
that ``p.grad`` over the ranks again, as DDP's all-reduce does. A loss-scaled gradient stays scaled, as under
Lightning's AMP, whose unscaling also covers only an optimizer's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.stage12.grad_sync import GradientReducer, sum_over_replicas
from lightning_zero.engine.stage12.zero_param import GradState
from lightning_zero.engine.state_dict import gather_full


def hand_over(reducer: GradientReducer, indices: Sequence[int], group: dist.ProcessGroup | None) -> None:
    """Collective: every rank passes the same indices, and has reduced the same ones."""
    sums: list[tuple[int, torch.Tensor]] = []
    for i in indices:
        held = reducer.local_grad(i) if reducer.records[i].state is GradState.REDUCED else None
        if held is not None:
            sums.append((i, held))
    if not sums:
        return
    if reducer.replicas > 1:
        sum_over_replicas(
            reducer.replicate_group, [held for _, held in sums], reducer.reduce_dtype, reducer.compression
        )
    coefficient = 1.0 / (reducer.world_size * reducer.replicas)
    full = [gather_full(held * coefficient, reducer.layout.params[i].shape, group=group) for i, held in sums]
    reducer.consume([i for i, _ in sums])
    for (i, _), grad in zip(sums, full):
        reducer.params[i].grad = grad


class UnsteppedLookup:
    """Looked up again only when the groups change (a callback adds one during ``fit``): a key of a few integers per
    group is all a step pays."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int], ...] | None = None
        self._indices: list[int] = []

    def __call__(self, params: Sequence[nn.Parameter], optimizers: Sequence[Optimizer]) -> list[int]:
        groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        key = tuple((id(group), len(group["params"])) for group in groups)
        if key != self._key:
            index = {id(p): i for i, p in enumerate(params)}
            stepped = {index.get(id(p)) for group in groups for p in group["params"]}
            self._indices = [i for i in range(len(params)) if i not in stepped]
            self._key = key
        return self._indices
