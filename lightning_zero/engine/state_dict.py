"""Per-parameter views of shards, gathered into full tensors (or sliced back) for checkpoints.

Every stage uses the dim-0 convention (``shard.py``), so :func:`gather_full` serves them all. Full state dicts are
produced in the plain formats, so a file written here loads into a model and optimizer with no ZeroStrategy at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.engine import shard
from lightning_zero.engine.comm import collectives


def gather_full(
    local: torch.Tensor, full_shape: torch.Size | tuple[int, ...], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Collective."""
    world = collectives.world_size(group)
    full_shape = torch.Size(full_shape)
    if world == 1:
        return local.reshape(full_shape).clone()
    chunk = shard.chunk_numel(full_shape, world)
    send = torch.zeros(chunk, dtype=local.dtype, device=local.device)
    send[: local.numel()].copy_(local.reshape(-1))
    out = torch.empty(chunk * world, dtype=local.dtype, device=local.device)
    collectives.all_gather(out, send, group=group)
    return out[: math.prod(full_shape)].view(full_shape)


def _gather(value: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A DTensor gathers over its own mesh's ranks (a hybrid run's shard group)."""
    if isinstance(value, DTensor):
        return gather_full(value.to_local(), shape, group=value.device_mesh.get_group())
    return gather_full(value, shape, group=group)


def full_model_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Collective."""
    keep = not rank0_only or collectives.rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = _gather(value, value.shape)
        if keep and isinstance(value, torch.Tensor):
            out[name] = value.detach().to("cpu", copy=True)
        elif keep:
            out[name] = value
    return out


def full_optimizer_state_dict(
    optimizer: Optimizer,
    hosted: Mapping[int, torch.Tensor],
    full_shapes: Mapping[int, torch.Size],
    rank0_only: bool = True,
    rows_group: dist.ProcessGroup | None = None,
    whole: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as an unsharded optimizer would return it. Collective.

    ``hosted``: the tensor the optimizer keys each parameter's state by; ``whole``: the parameters whose state one owner
    rank holds whole (matrix optimizers), sent from there.
    """
    keep = not rank0_only or collectives.rank() == 0
    state: dict[int, dict[str, Any]] = {}
    owned: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        ids = []
        for param in group["params"]:
            key = hosted.get(id(param), param)
            entry = optimizer.state.get(key)
            if whole is not None and id(param) in whole:
                if entry is not None:
                    owned[index] = {
                        k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                        for k, v in entry.items()
                    }
            elif entry is not None:
                shape = full_shapes.get(id(param), param.shape)
                full_entry = {}
                for name, value in entry.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and id(param) in full_shapes:
                        value = _gather(value, shape, rows_group)
                    if keep:
                        full_entry[name] = (
                            value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
                        )
                state[index] = full_entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    if whole is not None:  # a matrix optimizer on every rank alike
        parts = collectives.gather_objects(owned) if rank0_only else collectives.all_gather_objects(owned)
        for part in parts or ():
            state.update(part)
        state = dict(sorted(state.items()))
    return {"state": state, "param_groups": groups} if keep else {}
