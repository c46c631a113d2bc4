"""Error-feedback residuals in sharded checkpoints.

Each rank keeps its own residuals (what quantization dropped from the gradient chunks it sent, see
``engine/comm/compression.py``), and a resumed run that starts them from zero no longer ends where the uninterrupted
run ends. A sharded save therefore writes them too, as one DTensor of shape ``[world, width]`` sharded by rank
(``error_feedback.residuals``: row r is rank r's residuals end to end, zero-padded to the widest rank), and
``meta.pt`` keeps every rank's table of ``(name, numel)`` to cut its row apart again.

Residuals belong to one rank of one layout: they are restored only into a run of the same world size whose ranks
have the same tables. Any other resume (another world size, stage or bucket size) starts them from zero and says
so, which costs at most one step's quantization error, as at the start of a run.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from lightning_zero.engine.api import ShardingEngine
from lightning_zero.engine.comm import collectives, topology
from lightning_zero.engine.comm.compression import CompressedComm

KEY = "error_feedback"
TABLE_KEY = "error_feedback_tables"
SIGNATURE_KEY = "error_feedback_layout"


def _feedback(engine: ShardingEngine | None) -> CompressedComm | None:
    comm = engine.compression if engine is not None else None
    return comm if comm is not None and comm.feedback is not None else None


def _signature(engine: ShardingEngine, comm: CompressedComm) -> list[object]:
    """What residual names and sizes follow from: the world, the engine (stage), its groups and the compression."""
    spec = comm.spec
    return [
        collectives.world_size(),
        type(engine).__name__,
        engine.stage,
        engine.world_size,
        spec.gradients,
        spec.block_size,
        spec.inter_node_only,
        engine.bucket_layout(),
    ]


def _world_mesh(device_type: str):
    """A 1-D mesh of every rank (collective on first use in a world group: see ``topology.device_mesh``)."""
    return topology.device_mesh(device_type, (collectives.world_size(),))


def add_to_checkpoint(checkpoint: dict[str, Any], engine: ShardingEngine | None) -> None:
    """Collective: put this rank's residuals (a DTensor row) and every rank's table into ``checkpoint``."""
    comm = _feedback(engine)
    if engine is None or comm is None or not collectives.is_distributed():
        return
    residuals = comm.residuals()
    table = [(name, residuals[name].numel()) for name in sorted(residuals)]
    tables = collectives.all_gather_objects(table)
    width = max(sum(numel for _, numel in t) for t in tables)
    if width == 0:  # saved before the first step
        return
    device = next(iter(residuals.values())).device if residuals else torch.device("cpu")
    row = torch.zeros(1, width, dtype=torch.float32, device=device)
    if table:
        torch.cat([residuals[name].reshape(-1).float() for name, _ in table], out=row[0, : sum(n for _, n in table)])
    world = collectives.world_size()
    checkpoint[KEY] = {
        "residuals": DTensor.from_local(
            row,
            _world_mesh(device.type),
            [Shard(0)],
            run_check=False,
            shape=torch.Size((world, width)),
            stride=(width, 1),
        )
    }
    checkpoint[TABLE_KEY] = tables
    checkpoint[SIGNATURE_KEY] = _signature(engine, comm)


def placeholder(
    saved_shapes: dict[str, Any], checkpoint: dict[str, Any], engine: ShardingEngine | None
) -> dict[str, Any] | None:
    """What to ask DCP to load into, or None (and a warning when residuals are dropped) if they do not apply."""
    comm = _feedback(engine)
    shape = saved_shapes.get("residuals")
    if engine is None or comm is None or shape is None:
        return None
    if checkpoint.get(SIGNATURE_KEY) != _signature(engine, comm):
        warnings.warn(
            f"The checkpoint's error-feedback residuals were written by another layout ({checkpoint.get(SIGNATURE_KEY)}"
            f"; this run: {_signature(engine, comm)}: world size, engine, stage, shard group, compression, buckets). "
            "They belong to one rank's gradient chunks, so they start from zero (at most one step's quantization "
            "error, as at the start of a run).",
            stacklevel=2,
        )
        return None
    records = engine.records()
    device = records[0].param.device if records else torch.device("cpu")  # residuals follow their gradients
    row = torch.zeros(1, shape[1], dtype=torch.float32, device=device)
    return {
        "residuals": DTensor.from_local(
            row, _world_mesh(device.type), [Shard(0)], run_check=False, shape=torch.Size(shape), stride=(shape[1], 1)
        )
    }


def restore(loaded: dict[str, Any], checkpoint: dict[str, Any], engine: ShardingEngine | None) -> None:
    """Cut this rank's loaded row into its named residuals and hand them to the engine."""
    comm = _feedback(engine)
    if comm is None:
        raise RuntimeError("error-feedback residuals were loaded for a run without error feedback")
    row = loaded["residuals"].to_local()[0]
    table = checkpoint[TABLE_KEY][collectives.rank()]
    parts = row[: sum(numel for _, numel in table)].split([numel for _, numel in table])
    comm.load_residuals({name: part.clone() for (name, _), part in zip(table, parts)})


def warn_residuals_not_kept(engine: ShardingEngine | None) -> None:
    """A full checkpoint is rank 0's file alone: the other ranks' residuals are not in it."""
    if _feedback(engine) is not None:
        warnings.warn(
            "`state_dict_type='full'` checkpoints do not keep error feedback's per-rank residuals (a resume starts "
            "them from zero); sharded checkpoints (the default) do.",
            stacklevel=3,
        )
