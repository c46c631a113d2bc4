"""The process half of ZeroStrategy: launching, the process group, ranks, the collectives Lightning asks for
(barrier, broadcast, ``self.log(sync_dist=True)``), and the fault handling around them (``fault_handling.py``).

Lightning's own strategies layer the same way (``ParallelStrategy`` -> ``DDPStrategy``);
:class:`ProcessGroupStrategy` knows nothing of sharding, which :class:`~lightning_zero.strategy.zero_strategy.ZeroStrategy`
adds on top.
"""

from __future__ import annotations

import atexit
import time
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.engine.comm import collectives
from lightning_zero.faults.failures import note_sharded_call
from lightning_zero.faults.timeouts import long_timeout
from lightning_zero.pipeline.split import pipeline_layout
from lightning_zero.strategy.attempt_store import attempt_store, uses_torchrun_shared_store
from lightning_zero.strategy.fault_handling import FaultHandling
from lightning_zero.strategy.launcher import ZeroMultiProcessingLauncher, ZeroScriptLauncher


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


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device, a ``torch.distributed`` group over them, and a watchdog over that group."""

    def __init__(self, zero_config: ZeroConfig, **kwargs: Any) -> None:
        self.zero_config = zero_config
        self._num_nodes = 1
        self._failed = False  # a rank failed: teardown must not start collectives a failed peer never joins
        self._faults = FaultHandling()  # watchdog, timeouts, SIGTERM, first failure (fault_handling.py)
        super().__init__(**kwargs)

    @property
    @override
    def root_device(self) -> torch.device:
        return require(self.parallel_devices, "parallel_devices")[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to give every rank its own part of the data (a DistributedSampler)."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self.zero_config.process_group_backend

    @override
    def _configure_launcher(self) -> None:
        environment = require(self.cluster_environment, "cluster_environment")
        if (config := self.zero_config).pipeline_stages > 1:  # before any process starts: devices x nodes must divide
            pipeline_layout(config, self.num_nodes * self.num_processes)
        config.group_sizes(self.cluster_world_size(), self.num_processes)  # shard_size / hpZ fit the cluster
        if config.start_method == "popen":
            # Under torchrun/SLURM too (it then starts nothing): it resolves `ckpt_path` (auto-resume, "last").
            self._launcher = ZeroScriptLauncher(self, environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ZeroMultiProcessingLauncher(self, start_method=config.start_method)

    def cluster_world_size(self) -> int:
        """The ranks of the run: ``num_nodes x devices``, or what an external launcher (torchrun, SLURM) says when
        it started a different number (an uneven cluster, which ``shard_size="node"`` cannot split)."""
        environment = self.cluster_environment
        if environment is not None and environment.creates_processes_externally:
            return environment.world_size()
        return self.num_nodes * self.num_processes

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self.zero_config.process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        environment = require(self.cluster_environment, "cluster_environment")
        # A slow start is not a hang: `timeout` applies once the loops run (see faults/timeouts.py).
        timeout = long_timeout(self.zero_config.timeout_delta)
        _init_dist_connection(environment, backend, timeout=timeout, **self._store_for(timeout))
        atexit.unregister(_yield_to_collective_threads_at_exit)  # once per process, however many runs
        atexit.register(_yield_to_collective_threads_at_exit)  # see [Note: gloo's worker threads at exit]
        self._faults.start(self.zero_config, self.global_rank, self.world_size, self.num_processes)
        collectives.comm_stats().set_node_size(self.num_processes)  # intra- vs inter-node traffic

    def _store_for(self, timeout: timedelta) -> dict[str, Any]:
        """Under torchrun's shared agent store, a key space of this attempt's own (see
        [Note: torchrun's shared store across restarts]); elsewhere torch's own rendezvous."""
        environment = self.cluster_environment
        if environment is None or not uses_torchrun_shared_store():
            return {}
        return {
            "store": attempt_store(
                environment.main_address,
                environment.main_port,
                self.global_rank,
                self.world_size,
                timeout,
                self.zero_config.timeout_delta.total_seconds(),
            )
        }

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Both functions carry the rank as an attribute Lightning sets at run time, undeclared.
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        note_sharded_call(exception, self.zero_config.stage)
        self._faults.on_exception(exception)  # names the cause on every rank (faults/watchdog.py)

    def finish_processes(self) -> BaseException | None:
        """Teardown's first step, the exit agreement: a rank that finished while a peer still waits must fail,
        not report success. Returns the error to raise once teardown is done."""
        error = self._faults.finish(succeeded=not self._failed)
        self._failed = self._failed or error is not None
        return error

    def teardown_processes(self) -> None:
        require(self.cluster_environment, "cluster_environment").teardown()
        self.precision_plugin.teardown()
        require(self.accelerator, "accelerator").teardown()

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        return collectives.broadcast_object(obj, src=src, group=_group.WORLD)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """Reduce a tensor over ranks (``self.log(..., sync_dist=True)`` and metrics come through here)."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        op, divide = reduce_op_from_name(reduce_op)
        out = tensor.detach().clone() if tensor.requires_grad else tensor.clone()
        if not out.is_floating_point() and divide:
            out = out.float()
        collectives.all_reduce(out, op=op, group=group)
        return out / self.world_size if divide else out


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
