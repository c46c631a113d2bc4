"""The parameters one update behind, in checkpoints of a run with ``offload_step_delay=1``.

Between steps such a run has two versions of its trainable parameters (see [Note: the delayed update] in
``engine/offload/schedule.py``): the optimizer's rows, which hold every update taken, and the parameters
forward computes with, which lack the last one until the next step lands it. The checkpoint's ``state_dict`` is the
first (what every other reader of a checkpoint wants: consolidation, export, a run without the delay, evaluation);
the second is saved beside it under :data:`KEY`, by parameter name, in the layout of the model's entries: each
rank's rows as a dim-0 sharded DTensor in a sharded directory (so it loads at another world size too), whole
tensors on rank 0 in a full file. A resume with the delay puts them back as the parameters forward computes with
and lands the loaded rows at the next step, as the uninterrupted run would have; a resume without it ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_zero.checkpoint.state_dicts import as_sharded, loaded_rows
from lightning_zero.engine.api import ShardingEngine
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shard import local_rows
from lightning_zero.engine.state_dict import gather_full

KEY = "delayed_update"


def add_to_checkpoint(checkpoint: dict[str, Any], engine: ShardingEngine | None, full: bool) -> None:
    """Put the lagging parameters into ``checkpoint`` when an update is pending (collective when ``full``)."""
    delayed = engine.delayed_update if engine is not None else None
    rows = delayed.lagging_rows() if delayed is not None else None
    if engine is None or rows is None:
        return
    records = {record.name: record for record in engine.records()}
    if not full:  # a scalar is whole on every rank: saved as it is, as the model's own entry
        checkpoint[KEY] = {
            name: as_sharded(row, records[name].shape, engine.mesh)
            if records[name].shape
            else records[name].param.detach()
            for name, row in rows.items()
        }
        return
    whole = {
        name: gather_full(row, records[name].shape, group=records[name].group)
        if records[name].shape
        else records[name].param.detach()
        for name, row in rows.items()
    }
    if collectives.rank() == 0:
        checkpoint[KEY] = {name: tensor.to("cpu", copy=True) for name, tensor in whole.items()}


def placeholder(saved_shapes: Mapping[str, Any], engine: ShardingEngine | None) -> dict[str, torch.Tensor] | None:
    """What a sharded load reads the lagging parameters into, or None when the run has no delay or the checkpoint
    had no update pending."""
    if engine is None or engine.delayed_update is None or not saved_shapes:
        return None
    out: dict[str, torch.Tensor] = {}
    for record in engine.records():
        if record.name in saved_shapes:
            param = record.param.detach()
            rows = torch.empty_like(local_rows(param, engine.rank, engine.world_size))
            out[record.name] = as_sharded(rows, record.shape, engine.mesh) if record.shape else torch.empty_like(param)
    return out


def restore(lagging: Mapping[str, torch.Tensor] | None, engine: ShardingEngine | None) -> None:
    """Collective: make the loaded lagging parameters (``lagging``: DTensor rows of a sharded directory, whole tensors
    of a full file) the ones forward computes with. Nothing to do without a delay or without saved ones."""
    delayed = engine.delayed_update if engine is not None else None
    if engine is None or delayed is None or not lagging:
        return
    delayed.load_lagging_rows({name: loaded_rows(tensor, engine) for name, tensor in lagging.items()})
