"""Selective updates' state in checkpoints (``offload_update_interval > 1``).

Beside the optimizer's own state (which holds every column once the device's columns are written back), a run with
selective updates has what its schedule needs to go on exactly ([Note: selective updates] in
``engine/offload/selective.py``): each parameter's column step counts and chosen columns, the progress of the schedule,
and the interval's gradient sum. They are saved under :data:`KEY`, by parameter name: the counts, choice and progress
whole (the same on every rank), the sum as each rank's rows, a dim-0 sharded DTensor in a sharded directory (so it
loads at another world size too) and whole on rank 0 in a full file. The rows of a host step in flight are the
masters'; the parameters forward computes with, which lack them, are saved as the delayed update's are
(``delayed_update.py``).
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

KEY = "selective_updates"
#: Entries saved whole; ``sums`` is saved as rows.
WHOLE = ("column_steps", "selected", "progress")


def add_to_checkpoint(checkpoint: dict[str, Any], engine: ShardingEngine | None, full: bool) -> None:
    """Put the selective state into ``checkpoint`` (collective when ``full``)."""
    selective = engine.selective_updates if engine is not None else None
    if engine is None or selective is None:
        return
    state = selective.selective_state()
    if not state:
        return
    records = {record.name: record for record in engine.records()}
    if not full:
        checkpoint[KEY] = {
            name: {
                **{key: entry[key] for key in WHOLE},
                "sums": as_sharded(entry["sums"], records[name].shape, engine.mesh),
            }
            for name, entry in state.items()
        }
        return
    whole = {
        name: {
            **{key: entry[key] for key in WHOLE},
            "sums": gather_full(entry["sums"], records[name].shape, group=records[name].group),
        }
        for name, entry in state.items()
    }
    if collectives.rank() == 0:
        checkpoint[KEY] = {
            name: {key: tensor.to("cpu", copy=True) for key, tensor in entry.items()} for name, entry in whole.items()
        }


def placeholder(
    saved_shapes: Mapping[str, Any], engine: ShardingEngine | None
) -> dict[str, dict[str, torch.Tensor]] | None:
    """What a sharded load reads the selective state into, or None when the run has no selective updates or the
    checkpoint none saved (then the run starts its schedule afresh, its column counts from the optimizer's ``step``)."""
    selective = engine.selective_updates if engine is not None else None
    if engine is None or selective is None or not saved_shapes:
        return None
    saved = {key.rsplit(".", 1)[0] for key in saved_shapes}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for record in engine.records():
        if record.name not in saved:
            continue
        columns = saved_shapes[f"{record.name}.column_steps"]
        rows = torch.empty_like(local_rows(record.param.detach(), engine.rank, engine.world_size), dtype=torch.float32)
        out[record.name] = {
            "column_steps": torch.empty(columns, dtype=torch.float64),
            "selected": torch.empty(columns, dtype=torch.int8),
            "progress": torch.empty(saved_shapes[f"{record.name}.progress"], dtype=torch.int64),
            "sums": as_sharded(rows, record.shape, engine.mesh),
        }
    return out


def restore(loaded: Mapping[str, Mapping[str, torch.Tensor]] | None, engine: ShardingEngine | None) -> None:
    """After the optimizer's state: give the engine the loaded selective state (``loaded``: DTensor rows of a sharded
    directory, whole tensors of a full file). Nothing to do without selective updates or without saved state."""
    selective = engine.selective_updates if engine is not None else None
    if engine is None or selective is None or not loaded:
        return
    selective.load_selective_state(
        {
            name: {**{key: entry[key] for key in WHOLE}, "sums": loaded_rows(entry["sums"], engine)}
            for name, entry in loaded.items()
        }
    )
