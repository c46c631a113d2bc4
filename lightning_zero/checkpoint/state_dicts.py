"""The states a ZeroStrategy checkpoint saves, built from the engine's shard records.

Entries are keyed by the module's own parameter names whatever the stage. A full state holds plain tensors
in the ``state_dict`` / ``torch.optim`` layouts (it loads with no ZeroStrategy at all); a sharded state holds
this rank's rows of each parameter and optimizer-state tensor as a dim-0 sharded DTensor, so a directory
written with ``torch.distributed.checkpoint`` loads at any world size and stage. Under pipeline stages a rank
holds only its stages' tensors (``Holding``), sharded over its stage's data-parallel ranks (``engine.mesh``);
the saved state still holds every parameter once, under the unsplit model's names. A parameter a matrix
optimizer steps whole has its optimizer state on one owner rank (``engine/owner_step.py``): saved whole, as plain
tensors written by that rank, and loaded whole by whichever rank owns the parameter in the loading run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_zero.engine.api import Holding, ShardingEngine, ShardRecord
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shard import local_rows
from lightning_zero.engine.state_dict import full_model_state_dict, full_optimizer_state_dict, gather_full
from lightning_zero.torch_versions.dtensor import dtensor_over

#: Lightning's ``WeightAveraging`` key for the trained weights, where the checkpoint's ``state_dict`` holds their average.
CURRENT_MODEL_STATE = "current_model_state"


# ---------------------------------------------------------------------- who hosts which tensor
def hosted_tensors(optimizer: Optimizer, engine: ShardingEngine | None) -> dict[int, torch.Tensor]:
    """``id(param)`` -> the tensor the optimizer keys that parameter's state by, where it is not the
    parameter itself (a shard view, a master, a host copy)."""
    return {} if engine is None else engine.optimizer_shards(optimizer).hosted()


def owners_of(optimizer: Optimizer, engine: ShardingEngine | None) -> dict[int, int] | None:
    """``id(param)`` -> the rank holding that parameter's optimizer state whole; None: not a matrix optimizer."""
    return None if engine is None else engine.optimizer_shards(optimizer).owners_of()


def param_names(module: nn.Module) -> dict[int, str]:
    """``id(param)`` -> the name its optimizer state is saved and loaded under: its registered name, but for a
    parameter ``torch.nn.utils.prune`` re-registered as ``<name>_orig``, which keeps ``<name>``: Lightning's
    ``ModelPruning`` writes the pruned weight into checkpoints under ``<name>`` (pruning made permanent), and the
    module that loads them holds it under that name."""
    names: dict[int, str] = {}
    for prefix, sub in module.named_modules():
        pruned = {getattr(hook, "_tensor_name", None) for hook in sub._forward_pre_hooks.values()} - {None}
        for attr, p in sub.named_parameters(recurse=False):
            if id(p) not in names:
                base = attr.removesuffix("_orig")
                names[id(p)] = (f"{prefix}." if prefix else "") + (base if base != attr and base in pruned else attr)
    return names


def _held_state(module: nn.Module, holding: Holding) -> dict[str, Any]:
    """``module.state_dict()`` without the entries another pipeline stage holds."""
    return holding.held(module.state_dict())


def shard_coords(engine: ShardingEngine | None) -> tuple[int, int]:
    """(this rank's index, number of ranks) among those sharing each of its parameters."""
    if engine is not None:
        return engine.rank, engine.world_size
    return collectives.rank(), collectives.world_size()


def as_sharded(local: torch.Tensor, full_shape: torch.Size, mesh) -> torch.Tensor:
    """This rank's dim-0 rows ``local`` of a tensor of ``full_shape`` as a DTensor over ``mesh``. A 0-dim tensor is
    saved whole, as a plain tensor (its row: see :func:`whole_scalar`)."""
    if len(full_shape) == 0:
        return whole_scalar(local, mesh) if local.dim() == 1 else local
    stride = torch.empty(full_shape, device="meta").stride()
    return dtensor_over(local, mesh, [Shard(0)], full_shape, stride)


def loaded_rows(tensor: torch.Tensor, engine: ShardingEngine) -> torch.Tensor:
    """This rank's rows of a loaded tensor, :func:`as_sharded`'s inverse: a sharded directory's DTensor rows, or a
    full file's whole tensor cut to them."""
    return tensor.to_local() if isinstance(tensor, DTensor) else local_rows(tensor, engine.rank, engine.world_size)


def whole_scalar(row: torch.Tensor, mesh) -> torch.Tensor:
    """A 0-dim tensor from its one row (``engine/shard.py``: a 1-element view on rank 0 of ``mesh``, empty elsewhere),
    the same on every rank of ``mesh``, as a checkpoint holds an unsharded tensor. On the row's holder it is the row
    itself, so a checkpoint loaded into it lands there; the other ranks get a copy (collective)."""
    group, held = mesh.get_group(), row.numel() > 0
    shared = row.detach().view(()).clone() if held else torch.empty((), dtype=row.dtype, device=row.device)
    collectives.broadcast([shared], src=collectives.group_ranks(group)[0], group=group)
    return row.view(()) if held else shared


# ---------------------------------------------------------------------- state for saving
def full_optimizer_state(optimizer: Optimizer, module: nn.Module, engine: ShardingEngine | None) -> dict:
    hosted = hosted_tensors(optimizer, engine)
    shapes = {id(p): p.shape for p in module.parameters() if id(p) in hosted or isinstance(p, DTensor)}
    return full_optimizer_state_dict(
        optimizer,
        hosted,
        shapes,
        rows_group=engine.group if engine is not None else None,
        whole=owners_of(optimizer, engine),
    )


def trainable_rows(engine: ShardingEngine | None) -> dict[str, ShardRecord]:
    """Parameter name -> record, for the parameters whose checkpoint entry is the engine's rows rather than the
    module's tensor: whole resident parameters (stages 1-2; their rows are the fp32 masters under mixed
    precision), and stage 3's 0-dim parameters (whole on every rank: [Note: 0-dim parameters at stage 3]). Stage 3's
    other parameters are DTensors already, and are saved and loaded as they are."""
    if engine is None:
        return {}
    return {r.name: r for r in engine.records() if not isinstance(r.param, DTensor)}


def full_model_state(
    module: nn.Module, engine: ShardingEngine | None, rank0_only: bool = True, holding: Holding = Holding()
) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` (collective; empty on other ranks when ``rank0_only``)."""
    if not holding.everything:
        return _pipelined_full_state(module, engine, rank0_only, holding)
    state = full_model_state_dict(module, rank0_only=rank0_only)
    if engine is None or not engine.holds_masters:
        return state
    keep = not rank0_only or collectives.rank() == 0
    for name, record in trainable_rows(engine).items():  # the resident parameters are rounded copies
        full = gather_full(record.rows, record.shape, group=record.group)
        if keep:
            state[name] = full.to("cpu", copy=True)
    return state


def _pipelined_full_state(
    module: nn.Module, engine: ShardingEngine | None, rank0_only: bool, holding: Holding
) -> dict[str, torch.Tensor]:
    """Pipeline stages: each rank's held tensors (masters, and stage 3's sharded tensors, gathered over its
    stage's replicas), then every stage's, merged in the module's own order."""
    rows = trainable_rows(engine) if engine is not None and engine.holds_masters else {}
    held = {
        name: gather_full(rows[name].rows, rows[name].shape, group=rows[name].group) if name in rows else value
        for name, value in _held_state(module, holding).items()
    }  # the resident parameters are rounded copies
    return gather_stages(held, engine, list(module.state_dict()), rank0_only)


def gather_stages(
    held: dict[str, Any], engine: ShardingEngine | None, order: list[str], rank0_only: bool = True
) -> dict[str, Any]:
    """Every pipeline stage's ``held`` tensors (stage 3's DTensors gathered over the stage's replicas) on rank 0, or
    on every rank, whole and on the CPU, in ``order``. Collective."""
    whole = {}
    for name, value in held.items():
        if isinstance(value, DTensor):  # stage 3: the same names, in the same order, on the stage's replicas
            value = whole_tensor(value)
        whole[name] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    # The first replica of every stage sends its stage; other replicas hold copies of the same tensors.
    first_replica = engine is None or engine.group is None or engine.rank == 0
    mine = whole if first_replica else {}
    parts = collectives.gather_objects(mine, dst=0) if rank0_only else collectives.all_gather_objects(mine)
    if parts is None:
        return {}
    merged = {k: v for part in parts for k, v in part.items()}
    return {name: merged[name] for name in order if name in merged}


def whole_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, also for rows held in host memory over a device mesh (offloaded masters or
    parameter shards), which the mesh's backend cannot gather as they are. Collective."""
    local = value.to_local()
    if local.device.type != value.device_mesh.device_type:
        return gather_full(local, value.shape, group=value.device_mesh.get_group())
    return value.full_tensor()


def sharded_model_state(
    module: nn.Module, engine: ShardingEngine | None, holding: Holding = Holding()
) -> dict[str, Any]:
    """Parameter name -> this rank's rows (as a DTensor); buffers and frozen parameters as they are."""
    state = _held_state(module, holding)
    trainable = trainable_rows(engine)
    if not trainable or engine is None:
        return state
    for name in list(state):
        record = trainable.get(name)
        if record is not None:
            state[name] = as_sharded(record.rows, record.shape, engine.mesh)
    return state


def sharded_optimizer_state(optimizer: Optimizer, module: nn.Module, engine: ShardingEngine | None) -> dict[str, Any]:
    """``{"state": {param_name: {key: rows}}, "param_groups": [... "params": [names]]}``."""
    hosted = hosted_tensors(optimizer, engine)
    whole = owners_of(optimizer, engine) or {}
    names = param_names(module)
    mesh = engine.mesh if hosted and engine is not None else None
    state: dict[str, dict] = {}
    groups = []
    for group in optimizer.param_groups:
        group_names = []
        for param in group["params"]:
            name = names[id(param)]
            group_names.append(name)
            entry = optimizer.state.get(hosted.get(id(param), param))
            if entry is None:
                continue
            state[name] = {
                key: as_sharded(value, param.shape, mesh)
                if id(param) in hosted
                and id(param) not in whole
                and isinstance(value, torch.Tensor)
                and value.dim() > 0
                else value
                for key, value in entry.items()
            }
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    return {"state": state, "param_groups": groups}
