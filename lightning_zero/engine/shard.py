"""The one row-sharding rule: which rows of a tensor each rank holds (words: [Note: vocabulary] in ``engine/__init__.py``).

[Note: one shard convention for every stage]
Every parameter (and every optimizer-state tensor shaped like one) is split along dim 0 into ``world_size`` chunks of
``ceil(rows / world_size)`` rows; the last chunks may be short or empty, as ``torch.chunk`` and FSDP2's ``Shard(0)``
placement do. A 0-dim tensor counts as one row, held by rank 0. Stages 1-2 keep the whole parameter resident and let the
optimizer update a view of rank ``r``'s rows; stage 3 (FSDP2) keeps only those rows. Checkpoints, clipping, offload and
pretrained loading therefore see the same per-parameter shards whatever the stage, and a checkpoint written at one stage
and world size loads into another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def dim0_rows(shape: Sequence[int]) -> int:
    return shape[0] if len(shape) else 1


def row_numel(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) else 1


def rows_per_rank(shape: Sequence[int], world_size: int) -> int:
    return math.ceil(dim0_rows(shape) / world_size)


def chunk_numel(shape: Sequence[int], world_size: int) -> int:
    """What one rank sends or receives per collective."""
    return rows_per_rank(shape, world_size) * row_numel(shape)


def row_range(shape: Sequence[int], rank: int, world_size: int) -> tuple[int, int]:
    rows, per = dim0_rows(shape), rows_per_rank(shape, world_size)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def element_range(shape: Sequence[int], rank: int, world_size: int) -> tuple[int, int]:
    start, end = row_range(shape, rank, world_size)
    return start * row_numel(shape), end * row_numel(shape)


def local_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """A view; a 0-dim tensor gives a 1-element view on rank 0, empty elsewhere."""
    start, end = row_range(full.shape, rank, world_size)
    return full.view(1)[start:end] if full.dim() == 0 else full[start:end]
