"""Saving and loading ZeroStrategy checkpoints.

Two formats, one naming: entries are keyed by the module's own parameter names whatever the stage.

* ``"full"``: one Lightning ``.ckpt`` file written by rank 0 (temporary file, then rename), with a plain
  ``state_dict`` and ``torch.optim`` optimizer states holding full tensors.
* ``"sharded"``: a directory written with ``torch.distributed.checkpoint``; every rank writes only its own
  rows of each parameter and optimizer-state tensor, expressed as a dim-0 sharded DTensor so the same
  directory loads at any world size and stage. Under pipeline stages a rank holds only its stages' layers
  (the others are on the meta device) and its tensors are sharded over its stage's data-parallel ranks
  (``engine.mesh``); the directory still holds every parameter once, under the unsplit model's names, so it
  loads with or without pipelining.

Writing (atomic, every rank raises when one fails) is in ``checkpoint_write.py``, asynchronous saves in
``checkpoint_async.py``; this module builds the states to save and reads checkpoints back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_zero.checkpoint_files import remove  # noqa: F401 (re-exported: the strategy's removals)
from lightning_zero.checkpoint_verify import (
    META_FILE,
    CheckpointError,
    check_compatible,
    check_complete,
    check_listed,
    read_checkpoint_dict,
    read_manifest,
    saved_tensor_shapes,
    verify_archive,
    verify_files,
)
from lightning_zero.checkpoint_write import save_full, save_sharded  # noqa: F401 (re-exported)
from lightning_zero.engine import collectives
from lightning_zero.engine.api import ShardingEngine, ShardRecord
from lightning_zero.engine.state_dict import full_model_state_dict, full_optimizer_state_dict, gather_full, shard_rows
from lightning_zero.safe_load import dcp_load

SHARDED_MARKER = "lightning_zero_sharded"


# ---------------------------------------------------------------------- who hosts which tensor
def _hosted(optimizer: Optimizer, engine: ShardingEngine | None) -> dict[int, torch.Tensor]:
    """``id(param)`` -> the tensor the optimizer keys that parameter's state by, where it is not the
    parameter itself (a shard view, a master, a host copy)."""
    return {} if engine is None else engine.optimizer_shards(optimizer).hosted()


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _held_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` without the entries another pipeline stage holds (meta tensors here)."""
    return {k: v for k, v in module.state_dict().items() if not (isinstance(v, torch.Tensor) and v.is_meta)}


def _shard_coords(engine: ShardingEngine | None) -> tuple[int, int]:
    """(this rank's index, number of ranks) among those sharing each of its parameters."""
    if engine is not None:
        return engine.rank, engine.world_size
    return collectives.rank(), collectives.world_size()


def _as_sharded(local: torch.Tensor, full_shape: torch.Size, mesh) -> torch.Tensor:
    if len(full_shape) == 0:
        return local
    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full_shape, stride=stride)


# ---------------------------------------------------------------------- state for saving
def full_optimizer_state(optimizer: Optimizer, module: nn.Module, engine: ShardingEngine | None) -> dict:
    hosted = _hosted(optimizer, engine)
    shapes = {id(p): p.shape for p in module.parameters() if id(p) in hosted or isinstance(p, DTensor)}
    return full_optimizer_state_dict(optimizer, hosted, shapes)


def _trainable_rows(engine: ShardingEngine | None) -> dict[str, ShardRecord]:
    """Parameter name -> record, for the parameters whose checkpoint entry is the engine's rows rather than the
    module's tensor: whole resident parameters (stages 1-2; their rows are the fp32 masters under mixed
    precision). Stage 3's parameters are DTensors already, and are saved and loaded as they are."""
    if engine is None:
        return {}
    return {r.name: r for r in engine.records() if len(r.shape) > 0 and not isinstance(r.param, DTensor)}


def full_model_state(module: nn.Module, engine: ShardingEngine | None, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` (collective; empty on other ranks when ``rank0_only``)."""
    if any(t.is_meta for t in module.state_dict().values() if isinstance(t, torch.Tensor)):
        return _pipelined_full_state(module, engine, rank0_only)
    state = full_model_state_dict(module, rank0_only=rank0_only)
    if engine is None or not engine.holds_masters:
        return state
    keep = not rank0_only or collectives.rank() == 0
    for name, record in _trainable_rows(engine).items():  # the resident parameters are rounded copies
        full = gather_full(record.rows, record.shape, group=record.group)
        if keep:
            state[name] = full.to("cpu", copy=True)
    return state


def _pipelined_full_state(module: nn.Module, engine: ShardingEngine | None, rank0_only: bool) -> dict[str, torch.Tensor]:
    """Pipeline stages: each rank's held tensors (masters gathered over its stage's replicas), then every
    stage's, merged in the module's own order."""
    rows = _trainable_rows(engine) if engine is not None and engine.holds_masters else {}
    held = {}
    for name, value in _held_state(module).items():
        if name in rows:  # the resident parameters are rounded copies of the masters
            value = gather_full(rows[name].rows, rows[name].shape, group=rows[name].group)
        held[name] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    # The first replica of every stage sends its stage; other replicas hold copies of the same tensors.
    first_replica = engine is None or engine.group is None or engine.rank == 0
    mine = held if first_replica else {}
    parts = collectives.gather_objects(mine, dst=0) if rank0_only else collectives.all_gather_objects(mine)
    if parts is None:
        return {}
    merged = {k: v for part in parts for k, v in part.items()}
    return {name: merged[name] for name in module.state_dict() if name in merged}


def sharded_model_state(module: nn.Module, engine: ShardingEngine | None) -> dict[str, Any]:
    """Parameter name -> this rank's rows (as a DTensor); buffers and frozen parameters as they are."""
    state = _held_state(module)
    trainable = _trainable_rows(engine)
    if not trainable:
        return state
    for name in list(state):
        record = trainable.get(name)
        if record is not None:
            state[name] = _as_sharded(record.rows, record.shape, engine.mesh)
    return state


def sharded_optimizer_state(optimizer: Optimizer, module: nn.Module, engine: ShardingEngine | None) -> dict[str, Any]:
    """``{"state": {param_name: {key: rows}}, "param_groups": [... "params": [names]]}``."""
    hosted = _hosted(optimizer, engine)
    names = _param_names(module)
    mesh = engine.mesh if hosted else None
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
                key: _as_sharded(value, param.shape, mesh)
                if id(param) in hosted and isinstance(value, torch.Tensor) and value.dim() > 0
                else value
                for key, value in entry.items()
            }
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------- reading
def load(
    path: Path, module: nn.Module, optimizers: list[Optimizer], engine: ShardingEngine | None, strict: bool = True, weights_only: bool = True
) -> dict[str, Any]:
    """Read a checkpoint. A sharded directory is verified, checked against the model and loaded into the live
    shards here; a full file is returned for Lightning to hand to :func:`load_model_state` and
    :func:`load_optimizer_state`."""
    check_complete(path)
    _refuse_unsafe(weights_only)
    if path.is_file():
        _verify_in_parallel(path)
        return read_checkpoint_dict(path)
    _verify_in_parallel(path)
    checkpoint = read_checkpoint_dict(path / META_FILE)
    model_state = sharded_model_state(module, engine)
    # Checked against the whole model (another pipeline stage's tensors are meta here, with their shapes).
    check_compatible(
        saved_tensor_shapes(path, "state_dict"), _shapes(module.state_dict()), "model", strict=strict, checkpoint=path
    )
    elsewhere = {n for n, p in module.named_parameters() if p.is_meta}
    state = {"state_dict": model_state}
    names = _param_names(module)
    optimizer_entries = False
    # Under pipeline stages each stage's ranks check their own parameters: agree before loading together.
    with _on_every_rank():
        for i, optimizer in enumerate(optimizers):
            saved = saved_tensor_shapes(path, f"optimizer_{i}")
            if not saved:
                continue
            optimizer_entries = True
            saved = {key: shape for key, shape in saved.items() if key.rsplit(".", 1)[0] not in elsewhere}
            saved_params = {key.rsplit(".", 1)[0]: None for key in saved}
            hosted = _hosted(optimizer, engine)
            live_params = {
                names[id(p)]: None
                for group in optimizer.param_groups
                for p in group["params"]
                if (p.requires_grad and not p.is_meta) or id(p) in hosted  # frozen parameters have no state to restore
            }
            check_compatible(saved_params, live_params, f"optimizer {i}'s parameters", checkpoint=path)
            _materialize_optimizer_state(optimizer, engine)
            state[f"optimizer_{i}"] = sharded_optimizer_state(optimizer, module, engine)["state"]
            live = {f"{name}.{key}": None for name, entry in state[f"optimizer_{i}"].items() for key in entry}
            check_compatible(saved, live, f"optimizer {i} ({type(optimizer).__name__}) state", checkpoint=path)
    dcp_load(state, path, allow_partial_load=not strict)
    if engine is not None:
        engine.params_loaded()  # e.g. each rank loaded only its rows of the resident parameters
    for i, optimizer in enumerate(optimizers):
        groups = checkpoint.get("optimizer_param_groups", [])
        if i < len(groups):
            _load_param_group_hyperparameters(optimizer, groups[i])
    # Already loaded in place: leave Lightning's model/optimizer restore nothing to do. A weights-only
    # checkpoint has no optimizer entries, and Lightning then says so itself when asked to resume from it.
    checkpoint["state_dict"] = {}
    if optimizer_entries:
        checkpoint["optimizer_states"] = [{SHARDED_MARKER: True} for _ in optimizers]
    return checkpoint


def _refuse_unsafe(weights_only: bool) -> None:
    if weights_only is False:
        raise CheckpointError(
            "ZeroStrategy reads checkpoints with `weights_only=True` only: loading with `weights_only=False` could "
            "execute code from the file. Allow a type you trust with `torch.serialization.add_safe_globals([...])`."
        )


def _shapes(state: Mapping[str, Any]) -> dict[str, torch.Size | None]:
    return {k: (v.shape if isinstance(v, torch.Tensor) else None) for k, v in state.items()}


def _verify_in_parallel(path: Path) -> None:
    """Every rank checks a share of the files against the manifest (a full checkpoint: a share of its
    archive's records against their CRC-32s); all ranks raise the same first error."""
    rank, world = collectives.rank(), collectives.world_size()
    with _on_every_rank():
        if path.is_file():
            verify_archive(path, verify_archive(path, ())[rank::world])
            return
        manifest = read_manifest(path)
        if rank == 0:
            check_listed(path, manifest)
        verify_files(path, sorted(manifest)[rank::world])


@contextmanager
def _on_every_rank():
    """A :class:`CheckpointError` raised in the block on any rank is raised on every rank (after the block),
    so no rank goes on into a collective its peers never join."""
    error = None
    try:
        yield
    except CheckpointError as err:
        error = str(err)
    errors = [e for e in collectives.all_gather_objects(error) if e]
    if errors:
        raise CheckpointError(errors[0])


def _materialize_optimizer_state(optimizer: Optimizer, engine: ShardingEngine | None) -> None:
    """Create optimizer state (shard-sized, values to be overwritten) so a checkpoint loads into it in
    place: one step on zero gradients with the learning rate set to zero."""
    if optimizer.state:
        return
    hosted = _hosted(optimizer, engine)
    hosting = engine.optimizer_shards(optimizer).hosting() if hosted else nullcontext()
    shards = set(map(id, hosted.values()))
    with hosting:
        params = [
            p for g in optimizer.param_groups for p in g["params"] if (p.requires_grad and not p.is_meta) or id(p) in shards
        ]
        if any(p.grad is not None for p in params):
            return
        for p in params:
            p.grad = torch.zeros_like(p)
        lrs = [group.get("lr") for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p in params:
            p.grad = None


def _load_param_group_hyperparameters(optimizer: Optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(groups)} param groups but the current one has "
            f"{len(optimizer.param_groups)}."
        )
    for live, saved in zip(optimizer.param_groups, groups):
        live.update({k: v for k, v in saved.items() if k != "params"})


def load_model_state(module: nn.Module, state_dict: Mapping[str, Any], engine: ShardingEngine | None, strict: bool = True) -> None:
    """Load a full (unsharded) ``state_dict`` into the live model, keeping only this rank's rows."""
    if not state_dict:
        return
    check_compatible(_shapes(state_dict), _shapes(module.state_dict()), "model", strict=strict)
    copy_into_model(
        module, engine, {name: name for name in state_dict}, lambda key, rank, world: shard_rows(state_dict[key], rank, world),
        lambda key: state_dict[key],
    )


def copy_into_model(
    module: nn.Module,
    engine: ShardingEngine | None,
    sources: Mapping[str, str],
    read_rows: Callable[[str, int, int], torch.Tensor],
    read_full: Callable[[str], torch.Tensor],
) -> None:
    """Write tensors into the live model, each rank reading only what it holds: ``sources`` maps a live
    ``state_dict`` name to a source key; ``read_rows(key, rank, world)`` returns that rank's dim-0 rows of a
    sharded tensor (stage 3's DTensors, the engine's master rows at stages 1-2, which ``params_loaded`` then
    all-gathers), ``read_full(key)`` a tensor every rank holds whole. Collective when there is an engine."""
    rank, world = _shard_coords(engine)
    rows = _trainable_rows(engine)
    with torch.no_grad():
        for name, target in module.state_dict().items():
            key = sources.get(name)
            if key is None or target.is_meta:  # meta: another pipeline stage's tensor
                continue
            if isinstance(target, DTensor):
                target.to_local().copy_(read_rows(key, rank, world))
            elif name in rows:
                rows[name].rows.copy_(read_rows(key, rank, world))
            else:
                target.copy_(read_full(key))
    if engine is not None:
        engine.params_loaded()


def load_optimizer_state(optimizer: Optimizer, saved: Mapping[str, Any], module: nn.Module, engine: ShardingEngine | None) -> None:
    """Load a ``torch.optim``-format state (full tensors, index keys) into the sharded optimizer."""
    if SHARDED_MARKER in saved:
        return
    hosted = _hosted(optimizer, engine)
    rank, world = _shard_coords(engine)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    _load_param_group_hyperparameters(optimizer, saved["param_groups"])
    for index, entry in saved["state"].items():
        param = params[int(index)]
        if param.is_meta:
            continue  # another pipeline stage's parameter
        key = hosted.get(id(param), param)
        restored = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape:
                local = shard_rows(value, rank, world).to(key.device, copy=True)
                if key is param and isinstance(param, DTensor):
                    local = DTensor.from_local(
                        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
                    )
                value = local
            restored[name] = value
        optimizer.state[key] = restored
