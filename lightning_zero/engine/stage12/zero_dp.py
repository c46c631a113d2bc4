"""Stages 1 and 2: parameters stay whole on every rank, gradients and optimizer state are sharded.

One class serves both stages; they differ only in what the gradient reduction keeps (see ``grad_sync.py``). With a
mixed-precision policy or ``offload_optimizer`` the engine also owns master rows (see ``engine/offload/``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_zero.engine.api import Holding, ShardingEngine, ShardRecord
from lightning_zero.engine.comm import collectives, topology
from lightning_zero.engine.comm.compression import CompressedComm, CompressionSpec
from lightning_zero.engine.in_place_writes import InPlaceWrites
from lightning_zero.engine.mixed_precision import PrecisionPolicy, cast_parameters
from lightning_zero.engine.offload.masters import MasterShards
from lightning_zero.engine.offload.schedule import HostStepSchedule
from lightning_zero.engine.offload.selective import SelectiveSettings, SelectiveUpdates
from lightning_zero.engine.offload.worker import HostStepWorker, PendingUpdate
from lightning_zero.engine.optimizers import follow_zero_grad, optimizer_kind, shards_of, unfollow_zero_grad
from lightning_zero.engine.owner_step import OwnerStepping
from lightning_zero.engine.shard import local_rows
from lightning_zero.engine.stage12.grad_sync import GradientReducer
from lightning_zero.engine.stage12.layout import ShardLayout, plan_layout
from lightning_zero.engine.stage12.param_gather import all_gather_params
from lightning_zero.engine.stage12.params_outside_optimizers import UnsteppedLookup, hand_over
from lightning_zero.engine.stage12.replaced_storage import StorageWatch, hold_again
from lightning_zero.engine.stage12.sharded_optimizer import ShardedOptimizer
from lightning_zero.engine.stage12.zero_param import ZeroParam
from lightning_zero.engine.state_dict import gather_full
from lightning_zero.engine.state_dtype import StateDtype


class ZeroDataParallel:
    """Gradient sharding and sharded optimizer steps for a module whose parameters stay resident (a
    :class:`~lightning_zero.engine.api.ShardingEngine`)."""

    #: The module stays the user's; its parameters are whole on every rank.
    gathered_units = None

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        bucket_numel: int,
        overlap_comm: bool = True,
        policy: PrecisionPolicy | None = None,
        offload_optimizer: bool | float = False,
        pin_memory: bool = False,
        group: dist.ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        holding: Holding = Holding(),
        compression: CompressionSpec | None = None,
        offload_step_delay: int = 0,
        optimizer_state_dtype: str = "fp32",
        selective: SelectiveSettings | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel handles stages 1 and 2, got {stage}")
        self.module = module
        self.stage = stage
        self.group = group
        self._mesh = mesh  # see `mesh`
        self.replicate_group = replicate_group
        self.holding = holding
        held = holding.held(module.named_parameters())
        self.device_type = next((p.device.type for p in held.values()), "cpu")
        self.rank = collectives.rank(group)
        self.world_size = collectives.world_size(group)
        named = [(n, p) for n, p in held.items() if p.requires_grad]
        self._elsewhere = {id(p) for n, p in module.named_parameters() if not holding.holds(n)}
        self._bucket_numel, self._overlap_comm, self._policy = bucket_numel, overlap_comm, policy
        _check_contiguous(named)
        self.mixed = policy is not None
        #: Taken before the parameters are cast to their compute dtype.
        self.masters: MasterShards | None = None
        self.compression = CompressedComm(compression) if compression is not None and compression.enabled else None
        # Compressed parameters arrive rounded, this rank's rows too, so the optimizer needs exact masters.
        lossy_params = compression is not None and compression.params is not None
        if policy is not None or offload_optimizer or lossy_params:
            self.masters = MasterShards(
                [local_rows(p.detach(), self.rank, self.world_size) for _, p in named],
                dtype=policy.master_dtype if policy is not None else None,
                offloaded=offload_optimizer,
                pin=pin_memory,
                alias_on_device=policy is None and not lossy_params,
            )
        if policy is not None:
            cast_parameters(module, [p for _, p in named], policy)
        self._plan(named)
        #: See [Note: parameters written between steps] (not under the delayed update or selective updates, whose
        #: parameters lag anyway).
        lagging = bool(offload_step_delay) or selective is not None
        self.written = InPlaceWrites() if self.masters is not None and not lagging else None
        if self.written is not None:
            self.written.mark(self.params)
        #: See [Note: the delayed update] in ``engine/offload/schedule.py``.
        self.delayed = bool(offload_step_delay)
        #: See [Note: selective updates] in ``engine/offload/selective.py``.
        self.selective = selective
        #: See [Note: bf16 optimizer states] in ``engine/state_dtype.py``.
        self.optimizer_state_dtype = optimizer_state_dtype
        #: Where host steps run beside training (its thread starts with the first).
        self.worker = HostStepWorker(self.reducer.device)
        self._optimizers: dict[int, ShardedOptimizer] = {}
        self.growths: list[dict[str, float]] = []

    def _plan(self, named: list[tuple[str, nn.Parameter]]) -> None:
        params = [p for _, p in named]
        policy = self._policy
        self.layout: ShardLayout = plan_layout(
            [(n, tuple(p.shape)) for n, p in named],
            self.world_size,
            self._bucket_numel,
            # Each bucket has one dtype, so parameters kept in fp32 under a mixed policy, complex ones and any held in
            # another dtype than the rest get buckets of their own.
            classes=_by_dtype(params),
        )
        masters = self.masters.entries if self.masters is not None else [None] * len(params)
        #: One object per trainable parameter: its rows, gradient, master and record (``zero_param.py``).
        self.zero_params = [
            ZeroParam(i, p, spec, self.rank, master)
            for i, (p, spec, master) in enumerate(zip(params, self.layout.params, masters))
        ]
        for zp in self.zero_params:
            zp.record = self._record(zp)
        #: The parameters alone, for the helpers that take tensors (in the same order).
        self.params = params
        offloaded = self.masters is not None and self.masters.offloaded
        self.reducer = GradientReducer(
            self.zero_params,
            self.layout,
            rank=self.rank,
            shard_gradients=self.stage == 2,
            overlap_comm=self._overlap_comm,
            reduce_dtype=policy.reduce_dtype if policy is not None else None,
            master_dtype=policy.master_dtype if policy is not None else None,
            host_gradients=self.masters if offloaded else None,
            group=self.group,
            replicate_group=self.replicate_group,
            compression=self.compression,
        )
        self._unstepped_lookup = UnsteppedLookup()
        #: See [Note: parameters given new storage].
        self._storage = StorageWatch(self.params)
        laid_out = {id(p) for p in self.params}
        #: Frozen when the layout was planned: watched for being unfrozen.
        self._frozen = [p for p in self.holding.held(self.module.named_parameters()).values() if id(p) not in laid_out]

    def follow_trainability(self) -> bool:
        """Parameters made trainable during ``fit`` (``BackboneFinetuning``) join the layout; every rank changes the
        same parameters at the same point of the same script. Parameters frozen during ``fit`` stay laid out and produce
        no gradient, which the optimizer skips as PyTorch's does. Returns whether it grew."""
        self._follow_new_storage()
        if not any(p.requires_grad for p in self._frozen):  # runs every batch: keep it cheap
            return False
        started = time.perf_counter()
        held = self.holding.held(self.module.named_parameters())
        known = {id(p): i for i, p in enumerate(self.params)}
        grown = [(n, p) for n, p in held.items() if p.requires_grad and id(p) not in known]
        _check_contiguous(grown)
        named = [(n, p) for n, p in held.items() if id(p) in known or p.requires_grad]
        for handle in self._optimizers.values():
            if handle.selective is not None:  # the device's columns into the host masters, which stay
                handle.settle()
        if self.masters is not None:  # kept masters stay the same tensors: the optimizer keys its state by them
            rows = {id(p): local_rows(p.detach(), self.rank, self.world_size) for _, p in grown}
            self.masters.rebuild([known[id(p)] if id(p) in known else rows[id(p)] for _, p in named])
        if self._policy is not None:
            cast_parameters(self.module, [p for _, p in grown], self._policy)
        self.reducer.remove_hooks()
        self._plan(named)
        if self.written is not None:
            self.written.mark(p for _, p in grown)
        index = {id(p): i for i, p in enumerate(self.params)}
        for key, old in self._optimizers.items():
            moved = {i: index[id(p)] for i, p in enumerate(old.params) if id(p) in index}
            shards = {moved[i]: shard for i, shard in old.shards.items()}
            owners = old.owners.rekey(moved) if old.owners is not None else None
            carried = old.selective.rekey(moved) if old.selective is not None else None
            self._optimizers[key] = self._sharded_optimizer(
                old.optimizer, old.kind, shards, owners, old.schedule, carried
            )
        #: Reported by tests and the README.
        self.growths.append(
            {
                "params": len(grown),
                "elements": sum(p.numel() for _, p in grown),
                "seconds": time.perf_counter() - started,
            }
        )
        return True

    def _follow_new_storage(self) -> None:
        """See [Note: parameters given new storage]."""
        if moved := self._storage.moved():
            hold_again(
                [self.zero_params[i] for i in moved],
                [self.reducer.bucket_dtypes[self.layout.params[i].bucket] for i in moved],
                row_views=lambda i: [o.shards[i] for o in self._optimizers.values() if i in o.shards],
            )
            self._storage = StorageWatch(self.params)
            if self.written is not None:
                self.written.mark(self.params[i] for i in moved)

    # ------------------------------------------------------------------ the contract (engine/api.py)
    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = topology.device_mesh(self.device_type, (self.world_size,))
        return self._mesh

    @property
    def norm_group(self) -> dist.ProcessGroup | None:
        """Under hybrid sharding the shard group covers every row once; otherwise every rank does (pipeline
        stages hold disjoint layers, their replicas disjoint rows)."""
        return self.group if self.replicate_group is not None else None

    @property
    def holds_masters(self) -> bool:
        return self.masters is not None

    @property
    def optimizer_on_host(self) -> bool:
        return self.masters is not None and self.masters.offloaded

    def records(self) -> list[ShardRecord]:
        return [zp.record for zp in self.zero_params if zp.record is not None]

    def _record(self, zp: ZeroParam) -> ShardRecord:
        index = zp.index
        return ShardRecord(
            zp.name,
            zp.param,
            zp.param.shape,
            self.group,
            _rows=lambda: self.local_rows(index),
            _grad=lambda: self.reducer.local_grad(index),
        )

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor, bool]]:
        if self.masters is not None:
            yield from self.masters.state_tensors()
        # Host buffers among the finalized copies were yielded just above, by the masters.
        yield from (("grads", grad, False) for grad in self.reducer.held_gradients())

    # ------------------------------------------------------------------ optimizers
    def wrap_optimizer(
        self, optimizer: Optimizer, elementwise: tuple[type, ...] = (), matrix: tuple[type, ...] = ()
    ) -> None:
        kind = optimizer_kind(optimizer, self.stage, elementwise, matrix)
        self._optimizers[id(optimizer)] = self._sharded_optimizer(optimizer, kind)
        follow_zero_grad(optimizer, lambda: self.reducer.consume(self.optimizer_shards(optimizer).indices))

    def _sharded_optimizer(
        self,
        optimizer: Optimizer,
        kind: str,
        shards: dict[int, torch.Tensor] | None = None,
        owners: OwnerStepping | None = None,
        schedule: HostStepSchedule | None = None,
        carried: SelectiveUpdates | None = None,
    ) -> ShardedOptimizer:
        return ShardedOptimizer(
            optimizer,
            self.zero_params,
            self.layout,
            self.reducer,
            rank=self.rank,
            schedule=schedule
            or HostStepSchedule(
                optimizer, self.worker, delayed=self.delayed, states=StateDtype(self.optimizer_state_dtype)
            ),
            masters=self.masters,
            group=self.group,
            elsewhere=self._elsewhere,
            shards=shards,
            kind=kind,
            owners=owners,
            written=self.written,
            selective=self.selective,
            carried=carried,
        )

    def on_host(self, tensor: torch.Tensor) -> bool:
        if self.masters is not None and self.masters.holds_on_host(tensor):
            return True
        return any(o.owners is not None and o.owners.holds_on_host(tensor) for o in self._optimizers.values())

    def optimizer_shards(self, optimizer: Optimizer) -> ShardedOptimizer:
        return shards_of(self._optimizers, optimizer)

    def bucket_layout(self) -> list[int]:
        return [bucket.segment_numel for bucket in self.layout.buckets]

    def discard_all_gradients(self) -> None:
        """Start a new accumulation window, keeping the gradients handed to parameters no optimizer holds
        (see [Note: parameters no optimizer steps])."""
        kept = set(self._unstepped())
        self.reducer.consume([i for i in range(len(self.params)) if i not in kept] if kept else range(len(self.params)))

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.reducer.no_sync():
            yield

    @property
    def synchronizing(self) -> bool:
        return self.reducer.require_sync

    def step_during_backward(self, optimizer: Optimizer, clipped: bool = False) -> None:
        """See [Note: the host step during backward] (``engine/offload/schedule.py``): the caller vouches that nothing
        after this backward changes the gradients or skips the step."""
        shards = self._optimizers.get(id(optimizer))
        if shards is None or not self._overlap_comm or not self.reducer.require_sync or self.delayed:
            return
        if self.reducer.stages_on_landing and shards.step_during_backward(clipped):
            self.reducer.on_landed = shards.bucket_landed

    def post_backward(self) -> None:
        synchronizing = self.reducer.require_sync
        self.reducer.flush()
        if self.reducer.on_landed is not None:
            self.reducer.on_landed = None
            for shards in self._optimizers.values():
                shards.schedule.disarm()
        if synchronizing and (unstepped := self._unstepped()):
            hand_over(self.reducer, unstepped, self.group)

    def _unstepped(self) -> list[int]:
        return self._unstepped_lookup(self.params, [shards.optimizer for shards in self._optimizers.values()])

    def params_loaded(self) -> None:
        """Collective: checkpoint rows were written into :meth:`local_rows`."""
        all_gather_params(
            self.layout,
            self.params,
            range(len(self.layout.buckets)),
            rank=self.rank,
            group=self.group,
            masters=self.masters,
            compression=self.compression,
        )
        if self.written is not None:
            self.written.mark(self.params)

    def local_rows(self, index: int) -> torch.Tensor:
        """This rank's rows of trainable parameter ``index`` as the optimizer updates them; checkpoints read and
        write these."""
        if self.masters is not None:
            if self.delayed:
                self.worker.wait()  # a delayed host step may be writing them
            if self.selective is not None:  # the device's columns go back to the host masters first
                for shards in self._optimizers.values():
                    shards.settle()
            if self.written is not None:  # see [Note: parameters written between steps]
                self.written.take_back(self.masters, [index], self.params.__getitem__, self._resident_rows)
        return self.zero_params[index].optimizer_rows()

    def _resident_rows(self, index: int) -> torch.Tensor:
        return self.zero_params[index].resident_rows()

    # ------------------------------------------------------------------ the delayed update (see offload/schedule.py)
    @property
    def delayed_update(self) -> ZeroDataParallel | None:
        """This engine, under ``offload_step_delay`` or selective updates (an ``api.DelayedUpdate``): both have host
        steps whose rows reach the parameters forward computes with steps later."""
        return self if self.delayed or self.selective is not None else None

    def lagging_rows(self) -> dict[str, torch.Tensor] | None:
        if not any(o.schedule.pending is not None or o.selective_pending for o in self._optimizers.values()):
            return None
        return {zp.name: zp.resident_rows() for zp in self.zero_params}

    def load_lagging_rows(self, rows: Mapping[str, torch.Tensor]) -> None:
        if self.delayed_update is None:
            raise RuntimeError(
                "parameters one update behind were loaded into a run without offload_step_delay or selective updates"
            )
        with torch.no_grad():
            for zp in self.zero_params:
                if zp.name in rows:
                    zp.resident_rows().view(-1).copy_(rows[zp.name].reshape(-1))
        all_gather_params(self.layout, self.params, range(len(self.layout.buckets)), rank=self.rank, group=self.group)
        for optimizer in self._optimizers.values():
            if self.delayed:
                optimizer.schedule.pending = PendingUpdate()  # the masters hold it
            # selective updates: the pending step is restored with their state (``selective_state``)

    # ------------------------------------------------------------------ selective updates (see offload/selective.py)
    @property
    def selective_updates(self) -> ZeroDataParallel | None:
        """This engine, under selective updates (an ``api.SelectiveUpdateState``)."""
        return self if self.selective is not None else None

    def selective_state(self) -> dict[str, dict[str, torch.Tensor]]:
        state: dict[str, dict[str, torch.Tensor]] = {}
        for shards in self._optimizers.values():
            if shards.selective is not None:
                state.update(shards.selective.state_by_name())
        return state

    def load_selective_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        for shards in self._optimizers.values():
            if shards.selective is not None:
                shards.selective.load_state_by_name(state)

    def land_updates(self) -> None:
        for optimizer in self._optimizers.values():
            optimizer.land()

    def restore_master_params(self) -> None:
        """Collective: the end of a mixed run leaves the model in fp32, as Lightning's own mixed modes do."""
        self.land_updates()
        if not self.mixed or self.masters is None:
            return
        if self.selective is not None:  # the device's columns go back to the host masters first
            for shards in self._optimizers.values():
                shards.settle()
        self._follow_new_storage()  # ``ModelPruning`` assigns at the end
        if self.written is not None:
            self.written.take_back(self.masters, range(len(self.params)), self.params.__getitem__, self._resident_rows)
        with torch.no_grad():
            for param, master, spec in zip(self.params, self.masters, self.layout.params):
                param.data = gather_full(master.to(param.device), spec.shape, group=self.group)

    def teardown(self) -> None:
        self.reducer.remove_hooks()
        for shards in self._optimizers.values():
            unfollow_zero_grad(shards.optimizer)
        self.worker.close()


def _by_dtype(params: list[nn.Parameter]) -> list[int]:
    dtypes = sorted({str(p.dtype) for p in params})
    return [dtypes.index(str(p.dtype)) for p in params]


def _check_contiguous(named: list[tuple[str, nn.Parameter]]) -> None:
    for name, param in named:
        if not param.is_contiguous():
            raise ValueError(f"Parameter {name!r} is not contiguous; ZeroStrategy shards parameters by rows.")


if TYPE_CHECKING:  # the engine contract (``engine/api.py``)
    _ENGINE: type[ShardingEngine] = ZeroDataParallel
