"""The processes of a run: the process group, the collectives Lightning asks for (barrier, broadcast,
``self.log(sync_dist=True)``) and the fault handling around them (``fault_handling.py``). Knows nothing of sharding
nor of ``Trainer``: a strategy holds one :class:`DistributedProcesses`.
"""

from __future__ import annotations

import atexit
import time
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.engine.comm import collectives
from lightning_zero.faults.failures import note_sharded_call
from lightning_zero.faults.timeouts import long_timeout
from lightning_zero.strategy.attempt_store import attempt_store, uses_torchrun_shared_store
from lightning_zero.strategy.fault_handling import FaultHandling


def _yield_to_collective_threads_at_exit() -> None:
    """[Note: gloo's worker threads at exit]
    A synchronous gloo collective returns as soon as its work completes, and gloo's worker thread drops its own
    reference to the work a moment later. When Python has already dropped the tensor, that last reference
    owns the tensor's Python object, and releasing it takes the GIL. If the process reaches interpreter
    finalization inside that moment (a rank whose last act was a collective, then exit), the worker thread
    asks for the GIL during finalization, is ended by CPython, and the process aborts after everything has
    finished and been saved (``terminate called without an active exception``, exit code -6; the core shows
    the worker in ``~AsyncAllreduceWork`` -> ``take_gil`` -> ``pthread_exit``). Giving up the GIL for a moment
    at exit lets every such thread finish first: the precision-zoo test worker aborted in 4 of 25 launches
    without this and in none of 20 with it. Registered once the process group exists."""
    if dist.is_available() and dist.is_initialized():
        time.sleep(_EXIT_YIELD_SECONDS)


#: Long enough for a worker thread waiting on the GIL to take it and release a work (microseconds).
_EXIT_YIELD_SECONDS = 0.05


T = TypeVar("T")


class DistributedProcesses:
    """The process group over one process per device and the fault handling around it (watchdog, timeouts, SIGTERM,
    the exit agreement): what a Lightning front end drives, the ``Trainer`` strategy as a Fabric one would. It takes
    plain values (ranks, a cluster environment, a device), never a ``Trainer``."""

    def __init__(self, zero_config: ZeroConfig) -> None:
        self.zero_config = zero_config
        #: A rank failed: teardown must not start collectives a failed peer never joins.
        self.failed = False
        self.faults = FaultHandling()  # watchdog, timeouts, SIGTERM, first failure (fault_handling.py)

    def start(
        self,
        environment: ClusterEnvironment,
        device: torch.device,
        global_rank: int,
        world_size: int,
        local_processes: int,
    ) -> None:
        """Join the process group (a slow start is not a hang: ``timeout`` applies once the loops run, see
        ``faults/timeouts.py``) and start the watchdog over it."""
        self.failed = False
        backend = self.zero_config.process_group_backend or _get_default_process_group_backend_for_device(device)
        timeout = long_timeout(self.zero_config.timeout_delta)
        store = self._store_for(environment, global_rank, world_size, timeout)
        _init_dist_connection(environment, backend, timeout=timeout, **store)
        atexit.unregister(_yield_to_collective_threads_at_exit)  # once per process, however many runs
        atexit.register(_yield_to_collective_threads_at_exit)  # see [Note: gloo's worker threads at exit]
        self.faults.start(self.zero_config, global_rank, world_size, local_processes)
        collectives.comm_stats().set_node_size(local_processes)  # intra- vs inter-node traffic

    def _store_for(
        self, environment: ClusterEnvironment, global_rank: int, world_size: int, timeout: timedelta
    ) -> dict[str, Any]:
        """Under torchrun's shared agent store, a key space of this attempt's own (see
        [Note: torchrun's shared store across restarts]); elsewhere torch's own rendezvous."""
        if not uses_torchrun_shared_store():
            return {}
        seconds = self.zero_config.timeout_delta.total_seconds()
        store = attempt_store(
            environment.main_address, environment.main_port, global_rank, world_size, timeout, seconds
        )
        return {"store": store}

    def on_exception(self, exception: BaseException) -> None:
        """A rank failed: name the cause on every rank (``faults/watchdog.py``)."""
        self.failed = True
        note_sharded_call(exception, self.zero_config.shards_parameters)
        self.faults.on_exception(exception)

    def finish(self) -> BaseException | None:
        """Teardown's first step, the exit agreement: a rank that finished while a peer still waits must fail,
        not report success. Returns the error to raise once teardown is done."""
        error = self.faults.finish(succeeded=not self.failed)
        self.failed = self.failed or error is not None
        return error


def cluster_world_size(environment: ClusterEnvironment | None, num_nodes: int, num_processes: int) -> int:
    """The ranks of the run: ``num_nodes x devices``, or what an external launcher (torchrun, SLURM) says when it
    started a different number (an uneven cluster, which ``shard_size="node"`` cannot split)."""
    if environment is not None and environment.creates_processes_externally:
        return environment.world_size()
    return num_nodes * num_processes


def barrier() -> None:
    if _distributed_is_initialized():
        collectives.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    if not _distributed_is_initialized():
        return obj
    return collectives.broadcast_object(obj, src=src, group=_group.WORLD)


def reduce(tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOp | str | None, world_size: int) -> Tensor:
    """Reduce a tensor over ranks (``self.log(..., sync_dist=True)`` and metrics come through here)."""
    if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
        return tensor
    op, divide = reduce_op_from_name(reduce_op)
    out = tensor.detach().clone() if tensor.requires_grad else tensor.clone()
    if not out.is_floating_point() and divide:
        out = out.float()
    collectives.all_reduce(out, op=op, group=group)
    return out / world_size if divide else out


def require(value: T | None, what: str) -> T:
    """``value``: Lightning sets these up before calling the hook that needs them; say which one is missing if not."""
    if value is None:
        raise RuntimeError(
            f"ZeroStrategy needs `{what}`, which Lightning has not set up yet; use it through a Trainer."
        )
    return value


def reduce_op_from_name(reduce_op: collectives.ReduceOpLike | str | None) -> tuple[collectives.ReduceOpLike, bool]:
    """Lightning's reduce names ("mean", "sum", "max", "min") or a ReduceOp -> (op, divide by world)."""
    if reduce_op is None or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")):
        return dist.ReduceOp.SUM, True
    if isinstance(reduce_op, str):
        ops = {
            "sum": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
            "product": dist.ReduceOp.PRODUCT,
        }
        if reduce_op.lower() not in ops:
            raise ValueError(f"reduce_op={reduce_op!r} is not supported; choose one of {('mean', *ops)}.")
        return ops[reduce_op.lower()], False
    return reduce_op, False
