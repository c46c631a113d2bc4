"""Stage 3: parameters, gradients and optimizer state sharded by ``torch.distributed.fsdp.fully_shard``.

FSDP2 already shards per parameter along dim 0 (our convention), prefetches, and reshards after backward. This
adapter adds what ZeroStrategy promises on top: the wrap policy, shard-by-shard materialisation of meta-device models
with the values an eager build would have had, counted collectives, no-sync under gradient accumulation, and the
shard-level view the precision plugin needs for clipping.

[Note: stage 3 mixed precision]
FSDP2's ``MixedPrecisionPolicy`` gives the ZeRO-3 memory model directly: the sharded parameter stays fp32 and is the
master (a model built in bf16 is held in fp32 too, as stages 1-2 take fp32 masters of it), gathers are cast to the
compute dtype, gradients are reduced in ``reduce_dtype`` and land as fp32 shards. Layers that keep fp32 parameters (see
``mixed_precision.py``) become units of their own with an fp32 policy, as do layers held in another dtype than the
model's (``fsdp2_units.held_kinds``). Forward inputs are not cast (``cast_forward_inputs=False``): autocast decides per
operation, exactly as at stages 1 and 2, so the three stages compute the same thing.

[Note: merged units]
Each FSDP2 unit costs host work every step whatever its size: its forward and backward hooks, copies into and out of its
all-gather buffer, a reduce-scatter, their launches and waits. A model of many small layers (narrow blocks; under mixed
precision, every norm layer is an fp32 unit of its own) then spends its step in that work, not in arithmetic. Adjacent
units of one dtype are therefore merged into one ``fully_shard([a, b, ...])`` group while their gathered parameters fit
in ``unit_size_mb``, and the fp32 layers nested in one group form one fp32 group: the same arithmetic, with fewer
gathers and hooks. FSDP2 gathers a group at its first module's pre-forward, reshards it after its last module's forward,
and reduces it once after the backward of all of it. The price is memory in flight (a merged group is gathered whole,
two with prefetching), which the budget bounds; a layer larger than the budget stays a unit of its own, and so does a
unit whose units enclose units again (the rule then applies inside it).

[Note: stage 3 hybrid sharding and hpZ]
Hybrid sharding shards each unit over the ``"shard"`` sub-mesh only (``topology.py``) and sums each reduced gradient
shard across the replica group in FSDP2's all-reduce hook (``fsdp2_comm.SumOverReplicas``), both collectives summing and
one divide by the number of ranks. It is what FSDP2's 2-D mesh HSDP computes, but FSDP2 would issue that all-reduce
itself, uncounted. hpZ is FSDP2's ``reshard_after_forward=s``: after forward each unit stays sharded over ``s``
consecutive ranks, so backward's all-gather runs inside that group.

[Note: stage 3 offload]
``offload_params`` is FSDP2's ``CPUOffloadPolicy``: sharded parameters, their gradients and so the optimizer state live
in host memory, and the user's optimizer steps the host shards directly, each unit's in place during backward as FSDP2
finishes its gradients where nothing after backward changes them (``FullyShardedOptimizer._start_in_place``).
``offload_optimizer`` alone keeps the sharded parameters on the device and re-hosts the optimizer on host copies of them
(see ``engine/offload/``), as stages 1 and 2 do, a run of parameters at a time
(``FullyShardedOptimizer._step_in_parts``), each unit's run during backward where nothing after it changes the gradients
(see [Note: the host step during backward] in ``engine/offload/schedule.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.optim import Optimizer

from lightning_zero.engine.api import Holding, PipelineStages, ShardingEngine, ShardRecord
from lightning_zero.engine.comm import collectives, flight, topology
from lightning_zero.engine.comm.compression import CompressedComm, CompressionSpec
from lightning_zero.engine.comm.topology import DataParallelGroups
from lightning_zero.engine.mixed_precision import PrecisionPolicy, fsdp2_mixed_precision, hold_as_masters
from lightning_zero.engine.offload.masters import MasterShards
from lightning_zero.engine.offload.schedule import HostStepSchedule
from lightning_zero.engine.offload.worker import HostStepWorker
from lightning_zero.engine.optimizers import optimizer_kind, shards_of
from lightning_zero.engine.stage3 import fsdp2_backward_calls, fsdp2_functional_calls, fsdp2_private
from lightning_zero.engine.stage3.fsdp2_comm import (
    CountingAllGather,
    CountingReduceScatter,
    FinishedUnits,
    LateReductions,
    SumOverReplicas,
)
from lightning_zero.engine.stage3.fsdp2_missing_grads import UnusedParameters
from lightning_zero.engine.stage3.fsdp2_optimizer import FullyShardedOptimizer, local_grad
from lightning_zero.engine.stage3.fsdp2_prefetch import ForwardPrefetch
from lightning_zero.engine.stage3.fsdp2_units import (
    WrapPolicy,
    select_units,
    sharded_params,
    unit_groups,
    units_below_the_root,
    units_of_one_dtype,
    whole_params,
)
from lightning_zero.engine.stage3.fsdp2_window import GatheredWindow, GatheredWrites, hold_root_gathered
from lightning_zero.engine.stage3.fsdp2_zero_dim_params import ZeroDimParameters
from lightning_zero.engine.stage3.local_step import local_tensor
from lightning_zero.engine.stage3.materialize import has_meta, materialize_and_shard
from lightning_zero.engine.state_dtype import StateDtype


class FullyShardedEngine:
    """ZeRO stage 3 over FSDP2 (an ``engine/api.py`` ``ShardingEngine``)."""

    stage = 3
    #: The parameters' rows are the DTensor shards themselves; offload masters only mirror them.
    holds_masters = False

    def __init__(
        self,
        module: nn.Module,
        *,
        device: torch.device,
        wrap_policy: WrapPolicy | None = None,
        policy: PrecisionPolicy | None = None,
        offload_optimizer: bool | float = False,
        offload_params: bool = False,
        pin_memory: bool = False,
        groups: DataParallelGroups | None = None,
        secondary_shard_size: int | None = None,
        compression: CompressionSpec | None = None,
        unit_size_mb: float = 0.0,
        stages: PipelineStages | None = None,
        overlap_comm: bool = True,
        optimizer_state_dtype: str = "fp32",
    ) -> None:
        self.module = module
        #: See [Note: bf16 optimizer states] in ``engine/state_dtype.py``.
        self.optimizer_state_dtype = optimizer_state_dtype
        self.device, self.pin_memory = device, pin_memory
        self.policy = policy
        #: Units name their compression residuals by path.
        self.compression = CompressedComm(compression) if compression is not None and compression.enabled else None
        self.params_on_host = offload_params
        #: See [Note: stage 3 under pipeline stages]; the module itself is the one root otherwise.
        self.stages = stages
        self.roots: list[nn.Module] = list(stages.modules) if stages is not None else [module]
        #: ``fully_shard`` converts the module in place, unless pipeline stages' modules are the roots.
        self.shards_module_in_place = stages is None
        self.holding = stages.holding if stages is not None else Holding()
        self._spread_over_ranks(groups)
        self._choose_units(wrap_policy, secondary_shard_size, unit_size_mb)
        self._listen_to_reductions(overlap_comm)
        #: Where host steps run beside training (its thread starts with the first).
        self.worker = HostStepWorker(device)
        self._shard_module(offload_params, secondary_shard_size)
        self._follow_gathers(offload_params)
        self._index_trainable_parameters()
        self._optimizers: dict[int, FullyShardedOptimizer] = {}
        self.masters: MasterShards | None = None
        if offload_optimizer and not offload_params:
            self.masters = MasterShards(
                [record.rows for record in self._records],
                dtype=None,
                offloaded=offload_optimizer,
                pin=pin_memory,
                alias_on_device=True,
            )

    def _spread_over_ranks(self, groups: DataParallelGroups | None) -> None:
        """The ranks each parameter's rows are spread over: see [Note: stage 3 hybrid sharding and hpZ]; under pipeline
        stages, the ranks holding the same stages."""
        hybrid = groups if groups is not None and groups.replicas > 1 else None
        stages = self.stages
        self.group = hybrid.shard_group if hybrid is not None else None
        self.replicate_group = hybrid.replicate_group if hybrid is not None else None
        self.norm_group = self.group
        if stages is not None:  # the norm still sums over every rank
            self.group = stages.mesh.get_group()
        self.world_size = collectives.world_size(self.group)
        self.rank = collectives.rank(self.group)
        shard_mesh = stages.mesh if stages is not None else hybrid.shard_mesh if hybrid is not None else None
        self.mesh = shard_mesh if shard_mesh is not None else topology.device_mesh(self.device.type, (self.world_size,))
        self._all_ranks = collectives.world_size()  # a hybrid run's gradients average over every rank

    def _choose_units(
        self, wrap_policy: WrapPolicy | None, secondary_shard_size: int | None, unit_size_mb: float
    ) -> None:
        """The blocks the wrap policy picks, split by dtype, then merged into ``fully_shard`` groups: see [Note: merged
        units]."""
        policy = self.policy
        units = [unit for root in self.roots for unit in select_units(root, wrap_policy)]
        if secondary_shard_size:  # see [Note: hpZ and the root] in fsdp2_units.py
            units = [*units, *units_below_the_root(self.module, units)]
        self.units, kind = units_of_one_dtype(self.roots, units, policy)
        chosen = {id(m) for m in self.units}
        self._fp32_units = {id(m) for m in (*self.units, *self.roots) if policy is not None and policy.holds_fp32(m)}
        self.unit_groups: list[list[nn.Module]] = []
        for root in self.roots:
            below = [u for u in root.modules() if u is not root and id(u) in chosen]
            self.unit_groups += unit_groups(root, below, self._gathered_bytes, kind, unit_size_mb * 2**20)

    def _listen_to_reductions(self, overlap_comm: bool) -> None:
        """See [Note: reduce-scatters that land after backward] in ``fsdp2_comm.py``; on CUDA FSDP2's streams overlap
        them already. Not under hybrid sharding, whose all-reduce hook reads each shard at once, nor under a pipeline
        schedule, which reduces outside any backward. ``finished``: for the host step during backward."""
        alone = self.replicate_group is None and self.stages is None
        self.late = LateReductions() if alone and self.device.type == "cpu" else None
        self.finished = FinishedUnits() if overlap_comm and alone else None

    def _shard_module(self, offload_params: bool, secondary_shard_size: int | None) -> None:
        """``fully_shard`` each unit group, then each root; a module an earlier fit sharded gets this engine's
        collectives instead."""
        module, stages = self.module, self.stages
        self._unit_names = {id(m): name or "root" for name, m in module.named_modules()}
        self._offload_policy = CPUOffloadPolicy(pin_memory=self.pin_memory) if offload_params else OffloadPolicy()
        #: Under pipeline stages a unit stays gathered over a step's micro-batches: see [Note: stage 3 under
        #: pipeline stages] in ``pipeline/schedule.py``.
        self._reshard_after_forward = secondary_shard_size or stages is None
        self._heads: list[FSDPModule] = []
        if stages is not None:
            for index, root in zip(stages.indices, self.roots):
                self._unit_names[id(root)] = f"pipeline_stage_{index}"
            self._shard_stages()
        elif not isinstance(module, FSDPModule):  # else sharded by an earlier fit/validate/test on this module
            if has_meta(module, recurse=True):
                materialize_and_shard(module, self.device, self.unit_groups, self._shard)
            else:
                module.to(self.device)
                # Every rank must start from the same values before it keeps only its rows.
                collectives.broadcast([t.data for t in (*module.parameters(), *module.buffers())], src=0)
                for group in reversed(self.unit_groups):
                    self._shard(group)
            self._shard([module])
            fsdp2_backward_calls.gather_layers_called_in_backward(module)  # [Note: a unit's layers called in backward]
            fsdp2_functional_calls.refuse_functional_calls(module)  # [Note: functional calls on stage 3 units]
        else:  # this engine's collectives replace the earlier engine's, once per fully_shard call
            for sharded in fsdp2_private.unit_heads(module):
                self._set_collectives(sharded)
        for root in self.roots:
            fsdp2_private.check(root)  # a torch that moved a private name fails here, naming it
        self._roots = [cast(FSDPModule, root) for root in self.roots]

    def _follow_gathers(self, offload_params: bool) -> None:
        """What runs around FSDP2's gathers on a CPU, and within an accumulation window."""
        stages = self.stages
        #: See [Note: prefetching without streams]; on CUDA FSDP2 prefetches on its streams, and a pipeline schedule
        #: gathers each stage itself.
        self.prefetch = (
            ForwardPrefetch(self._roots[0], [group[0] for group in self.unit_groups])
            if self.device.type == "cpu" and stages is None
            else None
        )
        #: See [Note: writes into gathered parameters] and [Note: gathered accumulation windows] (not with
        #: ``offload_params``, whose parameters leave the device, nor under [Note: stage 3 under pipeline stages]).
        self.gathered_writes = GatheredWrites(g for root in self.roots for g in fsdp2_private.param_groups(root))
        self.window = GatheredWindow(self.module) if not offload_params and stages is None else None
        #: ``_unreduced``: the latest backward ran inside ``no_sync``, leaving its gradients whole.
        self._reducing, self._unreduced = True, False

    def _index_trainable_parameters(self) -> None:
        """The trainable parameters this rank holds, their records, and the watch over which of them got a gradient."""
        held = self.holding.held(self.module.named_parameters())
        named = [(n, p) for n, p in held.items() if p.requires_grad]
        self.params = [p for _, p in named]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        #: See [Note: 0-dim parameters at stage 3]; frozen ones too, which a callback may unfreeze.
        self.zero_dim = ZeroDimParameters(
            [p for p in held.values() if p.dim() == 0],
            self.rank,
            self.world_size,
            self.group,
            self.group if self.stages is not None else None,
        )
        self._records = [self._record(n, p) for n, p in named]
        #: See [Note: parameters some ranks leave without a gradient] (``fsdp2_missing_grads.py``).
        self.unused = UnusedParameters(list(held.values()), self.group, self.replicate_group)
        self.unused.watch(group for root in self.roots for group in fsdp2_private.param_groups(root))

    def _shard_stages(self) -> None:
        """Their layers were built whole and are the same on every replica (``pipeline/parallel.py``)."""
        if any(has_meta(root, recurse=True) for root in self.roots):
            raise ValueError(
                "`pipeline_stages > 1` with `stage=3` builds the model whole on every rank before the cut: "
                "build it in `__init__` or in `configure_model` without the meta device."
            )
        for root in self.roots:
            if isinstance(root, FSDPModule):  # sharded by an earlier run: [Note: a later run keeps the stage modules]
                for sharded in fsdp2_private.unit_heads(root):
                    self._set_collectives(sharded)
        for group in reversed(self.unit_groups):
            self._shard(group)
        for root in self.roots:
            self._shard([root])

    # ------------------------------------------------------------------ sharding
    def _gathered_bytes(self, unit: nn.Module) -> int:
        dtype = None if self.policy is None or id(unit) in self._fp32_units else self.policy.compute_dtype
        return sum(p.numel() * (dtype or p.dtype).itemsize for p in sharded_params(unit))

    def _shard(self, group: list[nn.Module]) -> None:
        first = group[0]
        if isinstance(first, FSDPModule):
            return
        if self.policy is not None:  # see [Note: stage 3 mixed precision]
            hold_as_masters(group, self.policy)
        # hpZ: the root stays gathered from forward to backward, as FSDP2's default root does ([Note: hpZ and the root])
        hpz_root = first is self.module and self._reshard_after_forward is not True
        sharded = fully_shard(
            first if len(group) == 1 else group,
            mesh=self.mesh,
            reshard_after_forward=False if hpz_root else self._reshard_after_forward,
            mp_policy=fsdp2_mixed_precision(self.policy, id(first) in self._fp32_units),
            offload_policy=self._offload_policy,
            ignored_params=whole_params(group),  # 0-dim and integer parameters: see ``sharded_by_fsdp2``
        )
        self._set_collectives(sharded[0] if isinstance(sharded, list) else sharded)
        fsdp2_private.keep_complex_params_complex(sharded[0] if isinstance(sharded, list) else sharded)
        fsdp2_private.skip_conversions_that_change_nothing(group)
        fsdp2_private.forget_classes_of_one_module()

    def _set_collectives(self, module: FSDPModule) -> None:
        name = self._unit_names.get(id(module), "root")
        module.set_custom_all_gather(CountingAllGather(self.compression, flight.unit_code(name)))
        module.set_custom_reduce_scatter(
            CountingReduceScatter(
                self.compression, name, module, self.late, self.finished, len(self._heads), alone=self.world_size == 1
            )
        )
        self._heads.append(module)
        if self.replicate_group is not None:
            module.set_force_sum_reduction_for_comms(True)  # sum in both collectives, then divide by every rank
            module.set_gradient_divide_factor(float(self._all_ranks))
            module.set_all_reduce_hook(SumOverReplicas(self.replicate_group, self.compression, name))

    # ------------------------------------------------------------------ the contract (engine/api.py)
    @property
    def optimizer_on_host(self) -> bool:
        return (self.masters is not None and self.masters.offloaded) or self.params_on_host

    def records(self) -> list[ShardRecord]:
        return self._records

    def _record(self, name: str, param: torch.Tensor) -> ShardRecord:
        if param in self.zero_dim:
            return self.zero_dim.record(name, param)
        return ShardRecord(
            name, param, param.shape, self.group, _rows=lambda: local_tensor(param), _grad=lambda: local_grad(param)
        )

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor, bool]]:
        if self.masters is not None:
            yield from self.masters.state_tensors()

    # ------------------------------------------------------------------ optimizers
    def wrap_optimizer(
        self, optimizer: Optimizer, elementwise: tuple[type, ...] = (), matrix: tuple[type, ...] = ()
    ) -> None:
        kind = optimizer_kind(optimizer, self.stage, elementwise, matrix)
        self._optimizers[id(optimizer)] = FullyShardedOptimizer(
            self,
            optimizer,
            HostStepSchedule(optimizer, self.worker, states=StateDtype(self.optimizer_state_dtype)),
            kind,
        )

    def on_host(self, tensor: torch.Tensor) -> bool:
        return (
            self.params_on_host
            or (self.masters is not None and self.masters.holds_on_host(tensor))
            or any(o.owners is not None and o.owners.holds_on_host(tensor) for o in self._optimizers.values())
        )

    def optimizer_shards(self, optimizer: Optimizer) -> FullyShardedOptimizer:
        return shards_of(self._optimizers, optimizer)

    def bucket_layout(self) -> None:
        """FSDP2 reduces each unit's gradients on their own."""

    def discard_all_gradients(self) -> None:
        """Lightning's ``zero_grad`` clears the sharded ``p.grad``, but not the whole gradients of a window that never
        reduced (its epoch ended inside it: ``on_train_batch_start`` returned -1)."""
        if self._unreduced:
            fsdp2_private.drop_unreduced_gradients(self.roots)
            self._unreduced = False

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A non-final micro-batch: no reduce-scatter, and its units stay gathered for the next one."""
        for root in self._roots:
            root.set_requires_gradient_sync(False)
        self._reducing = False
        if self.window is not None:
            self.window.hold()
        try:
            yield
        finally:
            for root in self._roots:
                root.set_requires_gradient_sync(True)
            self._reducing = True
            if self.window is not None:
                self.window.release_after_backward()

    @property
    def synchronizing(self) -> bool:
        return self._reducing

    def step_during_backward(self, optimizer: Optimizer, clipped: bool = False) -> None:
        """See [Note: the host step during backward] (``engine/offload/schedule.py``)."""
        shards = self._optimizers.get(id(optimizer))
        if shards is None or self.finished is None or not self._reducing:
            return
        if self.masters is None and not self.params_on_host:
            return
        if shards.step_during_backward(self._heads, clipped):
            self.finished.listen(shards.unit_finished)

    def post_backward(self) -> None:
        """A backward that reduced ends the accumulation window: every unit is sharded again."""
        self.land_gradients()
        if self._reducing:
            self.zero_dim.average_gradients()
        self._unreduced = not self._reducing
        if self.finished is not None and self.finished.listening:
            self.finished.finish()
            for shards in self._optimizers.values():
                shards.schedule.disarm()
        if self.prefetch is not None:
            self.prefetch.settle()
        if self._reducing:
            self.reshard()

    def reshard(self) -> None:
        """See [Note: gathered accumulation windows] and [Note: stage 3 under pipeline stages]."""
        if self.window is not None:
            self.window.close()
        elif self.stages is not None:
            for root in self.roots:
                fsdp2_private.reshard_all(root)

    def hold_root_gathered(self) -> Callable[[], None]:
        return hold_root_gathered(self.module)

    def land_gradients(self) -> None:
        """A backward not run through the strategy leaves its reductions in flight until the step."""
        self.unused.start()
        if self.late is not None:
            self.late.land_all()
        self.unused.forget_unused()

    def follow_trainability(self) -> bool:
        return False  # FSDP2 shards every parameter, trainable or not, and reduces whatever gradients backward produces

    def params_loaded(self) -> None:
        """Collective: a checkpoint was loaded into the sharded parameters."""
        self.zero_dim.share()
        if self.masters is not None:
            for i, record in enumerate(self._records):
                self.masters.refresh_from(i, record.rows)

    def restore_master_params(self) -> None:
        """FSDP2 keeps the sharded parameters at full precision and casts them per forward."""

    delayed_update = None  # ``offload_step_delay`` is a stage 1-2 setting
    selective_updates = None  # so is ``offload_update_interval``

    @property
    def gathered_units(self) -> FullyShardedEngine:
        """This engine: its parameters are DTensor shards gathered per unit (an ``api.GatheredUnits``)."""
        return self

    def teardown(self) -> None:
        """FSDP2's hooks live as long as the module; the host-step thread does not."""
        self.worker.close()


if TYPE_CHECKING:  # the engine contract (``engine/api.py``)
    _ENGINE: type[ShardingEngine] = FullyShardedEngine
