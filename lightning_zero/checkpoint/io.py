"""Reading ZeroStrategy checkpoints back into a live, sharded model and optimizer.

Two formats (``write.py`` writes them, atomically; ``async_save.py`` in the background):

* ``"full"``: one Lightning ``.ckpt`` file with a plain ``state_dict`` and ``torch.optim`` optimizer states;
  Lightning hands it to :func:`load_model_state` and :func:`load_optimizer_state`, which keep this rank's rows.
* ``"sharded"``: a ``torch.distributed.checkpoint`` directory; :func:`load` verifies it against its manifest
  (every rank a share of the files), checks names and shapes against the whole model and loads each rank's
  rows in place, at any world size and stage.

Nothing is unpickled except through ``safe_load.py``'s ``weights_only`` readers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.checkpoint import delayed_update, error_feedback, selective_updates
from lightning_zero.checkpoint.safe_load import dcp_load
from lightning_zero.checkpoint.state_dicts import (
    CURRENT_MODEL_STATE,
    hosted_tensors,
    owners_of,
    param_names,
    shard_coords,
    sharded_model_state,
    sharded_optimizer_state,
    trainable_rows,
)
from lightning_zero.checkpoint.verify import (
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
from lightning_zero.engine.api import Holding, ShardingEngine
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shard import local_rows
from lightning_zero.torch_versions.dtensor import dtensor_over

SHARDED_MARKER = "lightning_zero_sharded"
AVERAGE_LOADED = "lightning_zero_average_loaded"  # the weight average came with the sharded directory


# ---------------------------------------------------------------------- reading
def load(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    engine: ShardingEngine | None,
    strict: bool = True,
    weights_only: bool = True,
    holding: Holding = Holding(),
    average: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Read a checkpoint. A sharded directory is verified, checked against the model and loaded into the live
    shards here; a full file is returned for Lightning to hand to :func:`load_model_state` and
    :func:`load_optimizer_state`.

    ``average``: a ``WeightAveraging`` callback's tensors (``strategy/averaging_checkpoints.py``). A directory
    it wrote holds the average as ``state_dict`` and the trained weights as ``current_model_state``: the module
    takes the trained weights and ``average`` the average. From a directory without them both start from
    ``state_dict``. Without ``average`` the module takes ``state_dict``, as Lightning's loading does."""
    check_complete(path)
    _refuse_unsafe(weights_only)
    if path.is_file():
        _verify_in_parallel(path)
        return read_checkpoint_dict(path)
    _verify_in_parallel(path)
    checkpoint = read_checkpoint_dict(path / META_FILE)
    model_state = sharded_model_state(module, engine, holding)
    with_current = average is not None and bool(saved_tensor_shapes(path, CURRENT_MODEL_STATE))
    model_key = CURRENT_MODEL_STATE if with_current else "state_dict"
    # Checked against the whole model (another pipeline stage's tensors are meta here, with their shapes).
    check_compatible(
        saved_tensor_shapes(path, model_key), _shapes(module.state_dict()), "model", strict=strict, checkpoint=path
    )
    elsewhere = holding.elsewhere
    state = {model_key: model_state}
    if average is not None:
        check_compatible(
            saved_tensor_shapes(path, "state_dict"), _shapes(average), "weight average", strict=strict, checkpoint=path
        )
        average = holding.held(average)  # another pipeline stage's tensors are meta here
        if with_current:
            state["state_dict"] = average
    names = param_names(module)
    optimizer_entries = False
    # Under pipeline stages each stage's ranks check their own parameters: agree before loading together.
    with _on_every_rank():
        saved_groups = checkpoint.get("optimizer_param_groups", [])
        for i, optimizer in enumerate(optimizers):
            saved = saved_tensor_shapes(path, f"optimizer_{i}")
            if not saved:
                if i < len(saved_groups):  # saved before its first step (lr_find does): an empty state, as torch's
                    optimizer_entries = True
                    optimizer.state.clear()
                continue
            optimizer_entries = True
            saved = {key: shape for key, shape in saved.items() if key.rsplit(".", 1)[0] not in elsewhere}
            saved_params = {key.rsplit(".", 1)[0]: None for key in saved}
            hosted = hosted_tensors(optimizer, engine)
            live_params = {
                names[id(p)]: None
                for group in optimizer.param_groups
                for p in group["params"]
                if (p.requires_grad and holding.holds(names[id(p)])) or id(p) in hosted  # frozen ones have no state
            }
            if any(name not in live_params for name in saved_params):  # a parameter without state has none saved
                check_compatible(saved_params, live_params, f"optimizer {i}'s parameters", checkpoint=path)
            stateless = {pid for pid, name in names.items() if name not in saved_params}
            stateless |= {id(hosted[pid]) for pid in stateless if pid in hosted}  # the tensors their state is keyed by
            _materialize_optimizer_state(optimizer, engine, stateless)
            state[f"optimizer_{i}"] = sharded_optimizer_state(optimizer, module, engine)["state"]
            live = {f"{name}.{key}": None for name, entry in state[f"optimizer_{i}"].items() for key in entry}
            if owners_of(optimizer, engine) is not None:  # whole state sits on its owner: check every rank's together
                live = {key: None for part in collectives.all_gather_objects(sorted(live)) for key in part}
            check_compatible(saved, live, f"optimizer {i} ({type(optimizer).__name__}) state", checkpoint=path)
    residuals = error_feedback.placeholder(saved_tensor_shapes(path, error_feedback.KEY), checkpoint, engine)
    if residuals is not None:
        state[error_feedback.KEY] = residuals
    lagging = delayed_update.placeholder(saved_tensor_shapes(path, delayed_update.KEY), engine)
    if lagging is not None:
        state[delayed_update.KEY] = lagging
    selective = selective_updates.placeholder(saved_tensor_shapes(path, selective_updates.KEY), engine)
    if selective is not None:
        state[selective_updates.KEY] = selective
    dcp_load(state, path, allow_partial_load=not strict)
    if average is not None and not with_current:  # no average saved: it starts from the weights, as they do
        dcp_load({"state_dict": average}, path, allow_partial_load=not strict)
    if residuals is not None:
        error_feedback.restore(state[error_feedback.KEY], checkpoint, engine)
    if engine is not None:
        engine.params_loaded()  # e.g. each rank loaded only its rows of the resident parameters
        delayed_update.restore(lagging, engine)  # after: the parameters forward computes with, one update behind
        selective_updates.restore(selective, engine)  # after the optimizer's state: the device's columns come from it
    for i, optimizer in enumerate(optimizers):
        groups = checkpoint.get("optimizer_param_groups", [])
        if i < len(groups):
            _load_param_group_hyperparameters(optimizer, groups[i])
    # Already loaded in place: leave Lightning's model/optimizer restore nothing to do. A weights-only
    # checkpoint has no optimizer entries, and Lightning then says so itself when asked to resume from it.
    checkpoint["state_dict"] = {}
    checkpoint[AVERAGE_LOADED] = average is not None
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


def _materialize_optimizer_state(optimizer: Optimizer, engine: ShardingEngine | None, stateless: set[int]) -> None:
    """Create optimizer state (shard-sized, values to be overwritten) so a checkpoint loads into it in
    place: one step on zero gradients with the learning rate set to zero. ``stateless``: ``id``s of the parameters
    (and of the tensors their state is keyed by) that had no state when the checkpoint was saved (no gradient yet: an
    expert no token reached, a layer used later; or held by another pipeline stage): they get none, so their first
    step starts it as torch's does (a step count of 0, not 1)."""
    if optimizer.state:
        return
    hosted = hosted_tensors(optimizer, engine)
    # Under the engine's hosting a whole parameter another rank owns is out of the groups: it gets no state here.
    hosting = engine.optimizer_shards(optimizer).hosting() if engine is not None else nullcontext()
    shards = set(map(id, hosted.values()))
    with hosting:
        params = [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if (p.requires_grad or id(p) in shards) and id(p) not in stateless
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


def _row_of(state: object, key: torch.Tensor) -> bool:
    """Whether a live optimizer-state tensor is per element of a 0-dim parameter's row ``key`` (1 element or none)."""
    return isinstance(state, torch.Tensor) and key.dim() == 1 and state.shape == key.shape


def _load_param_group_hyperparameters(optimizer: Optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(groups)} param groups but the current one has "
            f"{len(optimizer.param_groups)}."
        )
    for live, saved in zip(optimizer.param_groups, groups):
        live.update({k: v for k, v in saved.items() if k != "params"})


def load_model_state(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    engine: ShardingEngine | None,
    strict: bool = True,
    holding: Holding = Holding(),
) -> None:
    """Load a full (unsharded) ``state_dict`` into the live model, keeping only this rank's rows."""
    if not state_dict:
        return
    check_compatible(_shapes(state_dict), _shapes(module.state_dict()), "model", strict=strict)
    copy_into_model(
        module,
        engine,
        {name: name for name in state_dict},
        lambda key, rank, world: local_rows(state_dict[key], rank, world),
        lambda key: state_dict[key],
        holding,
    )


def copy_into_model(
    module: nn.Module,
    engine: ShardingEngine | None,
    sources: Mapping[str, str],
    read_rows: Callable[[str, int, int], torch.Tensor],
    read_full: Callable[[str], torch.Tensor],
    holding: Holding = Holding(),
) -> None:
    """Write tensors into the live model, each rank reading only what it holds: ``sources`` maps a live
    ``state_dict`` name to a source key; ``read_rows(key, rank, world)`` returns that rank's dim-0 rows of a
    sharded tensor (stage 3's DTensors, the engine's master rows at stages 1-2, which ``params_loaded`` then
    all-gathers), ``read_full(key)`` a tensor every rank holds whole. Collective when there is an engine."""
    rank, world = shard_coords(engine)
    rows = trainable_rows(engine)
    with torch.no_grad():
        for name, target in module.state_dict().items():
            key = sources.get(name)
            if key is None or not holding.holds(name):
                continue
            if isinstance(target, DTensor):
                target.to_local().copy_(read_rows(key, rank, world))
            elif name in rows:
                rows[name].rows.copy_(read_rows(key, rank, world))
            else:
                target.copy_(read_full(key))
    if engine is not None:
        engine.params_loaded()


def load_optimizer_state(
    optimizer: Optimizer,
    saved: Mapping[str, Any],
    module: nn.Module,
    engine: ShardingEngine | None,
    holding: Holding = Holding(),
) -> None:
    """Load a ``torch.optim``-format state (full tensors, index keys) into the sharded optimizer, or, from a sharded
    directory, leave what :func:`load` wrote; either way held in the run's ``optimizer_state_dtype`` afterwards."""
    if SHARDED_MARKER not in saved:
        _load_full_optimizer_state(optimizer, saved, module, engine, holding)
    if engine is not None:
        engine.optimizer_shards(optimizer).state_loaded()


def _load_full_optimizer_state(
    optimizer: Optimizer,
    saved: Mapping[str, Any],
    module: nn.Module,
    engine: ShardingEngine | None,
    holding: Holding,
) -> None:
    hosted = hosted_tensors(optimizer, engine)
    whole = owners_of(optimizer, engine) or {}
    rank, world = shard_coords(engine)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = param_names(module)
    _load_param_group_hyperparameters(optimizer, saved["param_groups"])
    if any(p.dim() == 0 and id(p) in hosted and id(p) not in whole for p in params):
        # A 0-dim parameter's state is stepped as a row: which of its 0-dim entries are per element (an Adam
        # moment, not its step count) only the state the optimizer itself creates tells.
        _materialize_optimizer_state(
            optimizer, engine, {id(p) for n, p in module.named_parameters() if n in holding.elsewhere}
        )
    for index, entry in saved["state"].items():
        param = params[int(index)]
        if not holding.holds(names[id(param)]):
            continue
        key = hosted.get(id(param), param)
        if id(param) in whole:  # stepped whole: its owner alone holds the state, whole
            if whole[id(param)] == rank:
                optimizer.state[key] = {
                    name: value.to(key.device, copy=True)
                    if isinstance(value, torch.Tensor) and value.dim() > 0
                    else value
                    for name, value in entry.items()
                }
            continue
        restored, live = {}, optimizer.state.get(key, {})
        for name, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and (value.dim() > 0 or _row_of(live.get(name), key))
                and value.shape == param.shape
            ):
                local = local_rows(value, rank, world).to(key.device, copy=True)
                if key is param and isinstance(param, DTensor):
                    local = dtensor_over(local, param.device_mesh, param.placements, param.shape, param.stride())
                value = local
            restored[name] = value
        optimizer.state[key] = restored
