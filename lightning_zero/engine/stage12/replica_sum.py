"""Summing held gradient shards across the replica group of hybrid sharding, and the dtype a reduction runs in.

Under hybrid sharding (``topology.py``) the shard group's reduce-scatter leaves each rank the sum over its own
group; :meth:`GradientReducer.finalize` then sums those over the ranks holding the same rows, once per step (see
[Note: gradients are held as sums until finalized] in ``grad_sync.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.compression import CompressedComm


def sum_over_replicas(
    group: dist.ProcessGroup | None,
    tensors: list[torch.Tensor],
    reduce_dtype: torch.dtype | None,
    compression: CompressedComm | None = None,
) -> None:
    """Sum ``tensors`` in place over ``group``: one flat all-reduce per held dtype (every rank passes the same
    shapes), summed in the same dtype as the shard group's reduce-scatter (``reduce_dtype``, e.g. fp32 for the
    fp16 sums of ``16-mixed``), or compressed (``compression.py``)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for held, same in by_dtype.items():
        flat = torch.cat([t.reshape(-1) for t in same]).to(comm_dtype(held, reduce_dtype))
        if compression is not None:
            compression.sum_over(flat, group, key=str(held).removeprefix("torch."))
        else:
            collectives.all_reduce(flat, group=group)
        torch._foreach_copy_(
            same, [part.view_as(t) for part, t in zip(torch.split(flat, [t.numel() for t in same]), same)]
        )


def comm_dtype(held: torch.dtype, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """Sum in ``reduce_dtype`` unless the gradients are held in a wider dtype (fp32 layers of a mixed run)."""
    if reduce_dtype is None or held.itemsize > reduce_dtype.itemsize:
        return held
    return reduce_dtype
