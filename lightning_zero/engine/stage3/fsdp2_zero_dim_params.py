"""Stage 3's 0-dim parameters, which ``fully_shard`` refuses.

[Note: 0-dim parameters at stage 3]
A learned temperature or gate is often a 0-dim parameter (CLIP's ``logit_scale``), and FSDP2 refuses to shard one.
Changing its shape would change the user's module and its ``state_dict``, so every ``fully_shard`` call leaves such
parameters out (``ignored_params``) and they stay whole on every rank. The one-row rule (``engine/shard.py``) still
decides who steps one: rank 0 of the shard group steps a 1-element view and the other ranks an empty one, exactly as at
stages 1-2, so the gradient norm counts each once, the optimizer state exists once and checkpoints hold the same entries
as at stages 1-2. After each step the row's holder broadcasts the values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_zero.engine.api import ShardRecord
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shard import local_rows


class ZeroDimParameters:
    """See [Note: 0-dim parameters at stage 3]. ``average_group``: every data-parallel rank (all ranks, or a pipeline
    stage's replicas)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        average_group: dist.ProcessGroup | None,
    ) -> None:
        self.params = list(params)
        self.rank, self.world_size = rank, world_size
        self.group, self.average_group = group, average_group
        #: The persistent row views the optimizer keys its state by.
        self._rows = {id(p): local_rows(p.detach(), rank, world_size) for p in self.params}

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._rows

    def record(self, name: str, param: torch.Tensor) -> ShardRecord:
        return ShardRecord(
            name, param, param.shape, self.group, _rows=lambda: self.rows(param), _grad=lambda: self.grad_rows(param)
        )

    def rows(self, param: torch.Tensor) -> torch.Tensor:
        return self._rows[id(param)]

    def grad_rows(self, param: torch.Tensor) -> torch.Tensor | None:
        return None if param.grad is None else local_rows(param.grad, self.rank, self.world_size)

    def average_gradients(self) -> None:
        """Collective. A parameter no rank has a gradient for keeps none, as the sharded parameters' unused
        gradients do."""
        if not self.params:
            return
        count = len(self.params)
        flat = torch.zeros(2 * count, dtype=torch.float64, device=self.params[0].device)
        for k, param in enumerate(self.params):
            if param.grad is not None:
                flat[k], flat[count + k] = param.grad.double(), 1
        collectives.all_reduce(flat, group=self.average_group)
        average = flat[:count] / collectives.world_size(self.average_group)
        for k, (param, present) in enumerate(zip(self.params, flat[count:].tolist())):
            if present:
                param.grad = average[k].to(param.dtype, copy=True)

    def share(self) -> None:
        """Collective, after a step."""
        if not self.params or self.world_size == 1:
            return
        flat = torch.stack([p.detach().double() for p in self.params])
        collectives.broadcast([flat], src=collectives.group_ranks(self.group)[0], group=self.group)
        with torch.no_grad():
            for k, param in enumerate(self.params):
                param.copy_(flat[k])
