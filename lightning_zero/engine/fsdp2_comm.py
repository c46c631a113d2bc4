"""FSDP2's collectives, routed through ``collectives.py`` so stage 3 is counted, labelled and watched like
stages 1-2 (``fully_shard`` modules take them via ``set_custom_all_gather`` / ``set_custom_reduce_scatter``, and
hybrid sharding's sum across replicas via ``set_all_reduce_hook``), and compressed like them (``compression.py``)
when the run asks for it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from lightning_zero.engine import collectives
from lightning_zero.engine.collectives import ReduceOp
from lightning_zero.engine.compression import CompressedComm


class CountingAllGather(AllGather):
    """FSDP2's all-gather, counted and labelled like ours; compressed parameters with ``compression``."""

    def __init__(self, compression: CompressedComm | None = None) -> None:
        self.compression = compression

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        # FSDP2 gathers a unit in uint8 when its parameters' dtypes differ: such bytes travel as they are.
        if self.compression is not None and self.compression.compresses_params(output_tensor.dtype):
            return self.compression.all_gather(output_tensor, input_tensor, group, async_op=False)
        # FSDP2 only waits on a real `dist.Work`; complete ring gathers before returning.
        work = collectives.all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        return work if isinstance(work, dist.Work) else collectives.finish(work)


class CountingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, counted and labelled like ours (FSDP2 picks the reduce op); compressed gradients
    with ``compression``, whose error-feedback residuals this unit's ``key`` names."""

    def __init__(self, compression: CompressedComm | None = None, key: str = "") -> None:
        self.compression, self.key = compression, key

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        # FSDP2 asks for AVG in fp32/bf16 (SUM, then a divide, is the same arithmetic) and SUM otherwise.
        if op in (ReduceOp.SUM, ReduceOp.AVG) and not async_op:
            if self.compression is not None:
                self.compression.reduce_scatter(output_tensor, input_tensor, group, self.key, async_op=False)
            else:
                collectives.reduce_scatter(output_tensor, input_tensor, group=group)
            if op == ReduceOp.AVG:
                output_tensor.div_(collectives.world_size(group))
            return None
        return collectives.reduce_scatter_op(output_tensor, input_tensor, op, group=group, async_op=async_op)


class SumOverReplicas:
    """FSDP2's all-reduce hook under hybrid sharding: sum a unit's reduced gradient shard (in the reduce dtype)
    over the ranks holding the same rows."""

    def __init__(self, group: dist.ProcessGroup, compression: CompressedComm | None = None, key: str = "") -> None:
        self.group, self.compression, self.key = group, compression, key

    def __call__(self, reduced: torch.Tensor) -> None:
        if self.compression is not None:
            self.compression.sum_over(reduced, self.group, self.key)
        else:
            collectives.all_reduce(reduced, group=self.group)
