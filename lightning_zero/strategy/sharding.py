"""From the user's module to a sharded one, for the strategy's ``setup``: activation checkpointing, the pipeline
cut, the same initial weights on every replica, the engine, pretrained weights.

This is the one place that asks for the stage: stage 3 is :class:`FullyShardedEngine` (FSDP2, whose
``configure_model`` runs on the meta device), stages 1-2 are :class:`ZeroDataParallel`, optionally on the
data-parallel groups of pipeline stages. Everything after ``setup`` talks to the result through
``engine/api.py``'s contract and :class:`ShardedModel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.activation_checkpointing import (
    CheckpointPolicy,
    apply_activation_checkpointing,
    caches_off_for_training,
)
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.engine.api import Holding, ShardingEngine
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.compression import CompressionSpec
from lightning_zero.engine.comm.topology import Topology, data_parallel_groups
from lightning_zero.engine.mixed_precision import PrecisionPolicy
from lightning_zero.engine.offload.masters import should_pin
from lightning_zero.engine.offload.selective import SelectiveSettings
from lightning_zero.engine.row_major import dense_embedding_gradients, store_row_major
from lightning_zero.engine.stage3.fsdp2 import FullyShardedEngine
from lightning_zero.engine.stage3.fsdp2_units import select_units
from lightning_zero.engine.stage3.materialize import has_meta, refuse_uninitialised
from lightning_zero.engine.stage12.layout import check_initialized, check_trainable
from lightning_zero.engine.stage12.zero_dp import ZeroDataParallel
from lightning_zero.engine.state_dict import gather_full
from lightning_zero.pipeline.parallel import PipelineParallel
from lightning_zero.pretrained import load_pretrained
from lightning_zero.strategy.compiling import compile_units
from lightning_zero.tiled_compute import apply_tiled_compute


def construction_device(config: ZeroConfig) -> contextlib.AbstractContextManager:
    """Where ``configure_model`` builds layers: stage 3 on the meta device (FSDP2 materialises one unit at a
    time, so no rank ever holds the whole model), the others where they are. Pipeline stages build the model
    whole, then free the layers of other stages (``pipeline/parallel.py``), at every stage."""
    on_meta = config.shards_parameters and config.pipeline_stages == 1
    return torch.device("meta") if on_meta else contextlib.nullcontext()


def _nothing() -> None:
    """What a run that changed nothing for training undoes after it."""


@dataclasses.dataclass
class ShardedModel:
    """What ``setup`` made of the module: its engine (None when evaluating at stages 1-2, which need none),
    this rank's pipeline stages, and what this rank holds."""

    engine: ShardingEngine | None
    pipeline: PipelineParallel | None
    holding: Holding
    buffers: list[Tensor]
    """The held buffers, broadcast from the first replica before steps (DDP's ``broadcast_buffers``)."""
    after_fit: Callable[[], None] = _nothing
    """Undoes what only training needed (Hugging Face caches turned off under activation checkpointing, embeddings'
    sparse gradients)."""

    @property
    def shards_module_in_place(self) -> bool:
        gathered = self.engine.gathered_units if self.engine is not None else None
        return gathered is not None and gathered.shards_module_in_place

    def sync_buffers(self) -> None:
        """Rank 0's buffers (e.g. BatchNorm running statistics) on every replica, so results and checkpoints
        agree whichever rank they come from. Under pipeline stages, each stage's replicas hold its buffers."""
        if self.buffers:
            group, source = (self.pipeline.dp_group, self.pipeline.dp_source) if self.pipeline else (None, 0)
            collectives.broadcast(self.buffers, src=source, group=group)

    def gather_gradients(
        self, optimizers: Iterable[Optimizer], finalize: Callable[[Optimizer], object]
    ) -> dict[str, Tensor]:
        """Full gradients by parameter name, on every rank (collective); ``finalize`` averages/unscales first."""
        if self.engine is None:
            raise RuntimeError("gather_gradients() needs a fitted ZeroStrategy (call it during `fit`).")
        out: dict[str, Tensor] = {}
        for optimizer in optimizers:
            finalize(optimizer)
            for record in self.engine.optimizer_shards(optimizer).records():
                if (local := record.grad) is not None:
                    out[record.name] = gather_full(local, record.shape, group=record.group)
        if self.pipeline is not None:  # each stage's ranks gathered that stage's gradients
            out = {k: v for part in collectives.all_gather_objects(out) for k, v in part.items()}
        return out


NOT_SHARDED = ShardedModel(None, None, Holding(), [])


def shard_model(
    model: nn.Module,
    config: ZeroConfig,
    *,
    policy: PrecisionPolicy | None,
    checkpoint_policy: CheckpointPolicy | None,
    fitting: bool,
    rank: int,
    world_size: int,
    node_size: int,
    device: torch.device,
    move_to_device: Callable[[], None],
    sync_batchnorm: bool = False,
) -> ShardedModel:
    """Shard ``model`` in place for a run (``fitting``: with gradients and optimizers; else evaluation)."""
    _check_not_sharded_elsewhere(model, config)
    check_initialized(model)
    policy = policy.bound_to(model) if policy is not None else None
    if fitting:
        check_trainable(model)
    afterwards: list[Callable[[], None]] = []
    if fitting or config.shards_parameters:
        _in_the_shards_form(model, fitting, afterwards)
    if fitting and config.tiled_compute is not False:
        tile_size = None if config.tiled_compute is True else int(config.tiled_compute)
        afterwards.append(apply_tiled_compute(model, tile_size))
    if checkpoint_policy is not None:
        # Before sharding: FSDP2 then re-gathers parameters for the recomputation like for any backward.
        checkpointed = apply_activation_checkpointing(model, checkpoint_policy, config.pin_memory)
        if fitting:
            afterwards.append(caches_off_for_training(model, checkpointed))
    pin = should_pin(device, config.pin_memory) if config.optimizer_on_host else False
    pipeline: PipelineParallel | None = None
    engine: ShardingEngine | None = None
    holding = Holding()
    shard_size, secondary_shard_size = config.group_sizes(world_size, node_size)
    groups = data_parallel_groups(Topology(world_size, node_size, shard_size), device.type)
    # Data-parallel ranks (`replicas`, which start from the first one's weights and buffers) and the ranks each
    # parameter's rows are spread over (`group`): all and all, or a pipeline stage's replicas, or hybrid.
    replicas, source, group, mesh = None, 0, groups.shard_group, groups.shard_mesh
    if config.pipeline_stages > 1:
        if sync_batchnorm:
            raise ZeroConfigError("`sync_batchnorm=True` is not supported with `pipeline_stages > 1`.")
        pipeline = PipelineParallel(model, config, rank, world_size, device)
        group, source, mesh, holding = pipeline.dp_group, pipeline.dp_source, pipeline.dp_mesh, pipeline.holding
        replicas = group
    if pipeline is not None or not config.shards_parameters:  # stage 3 alone starts from rank 0's values as it shards
        if pipeline is None:
            move_to_device()
        held = holding.held((*model.named_parameters(), *model.named_buffers()))
        collectives.broadcast([t.data for t in held.values()], src=source, group=replicas)
    # See [Note: materialising meta modules in construction order]: checked once pretrained weights had their say.
    built_on_meta = config.shards_parameters and pipeline is None and has_meta(model, recurse=True)
    if config.shards_parameters:
        engine = FullyShardedEngine(
            model,
            device=device,
            wrap_policy=config.wrap_policy,
            policy=policy,
            offload_optimizer=fitting and config.offload_optimizer,
            offload_params=config.offload_params,
            pin_memory=pin,
            groups=groups,
            secondary_shard_size=secondary_shard_size,
            compression=compression_spec(config),
            unit_size_mb=config.unit_size_mb,
            stages=pipeline.stages if pipeline is not None else None,
            overlap_comm=config.overlap_comm,
            optimizer_state_dtype=config.optimizer_state_dtype,
        )
    elif fitting:
        engine = ZeroDataParallel(
            model,
            stage=config.chosen_stage,
            bucket_numel=config.bucket_numel,
            overlap_comm=config.overlap_comm,
            policy=policy,
            offload_optimizer=config.offload_optimizer,
            pin_memory=pin,
            group=group,
            mesh=mesh,
            replicate_group=groups.replicate_group,
            holding=holding,
            compression=compression_spec(config),
            offload_step_delay=config.offload_step_delay,
            optimizer_state_dtype=config.optimizer_state_dtype,
            selective=selective_settings(config),
        )
    if config.init_weights is not None:
        load_pretrained(
            model,
            config.init_weights,
            strict=config.init_weights_strict,
            prefix=config.init_weights_prefix,
            engine=engine,
            holding=holding,
        )
    if built_on_meta:
        refuse_uninitialised(model)
    if config.compile:  # see compiling.py
        gathered = engine.gathered_units if engine is not None else None
        units = gathered.units if gathered is not None else None  # the engine's blocks, where it divided the module
        compile_units(units if units is not None else select_units(model, config.wrap_policy), config.compile)
    buffers = list(holding.held(model.named_buffers()).values())

    def after_fit() -> None:
        for back in afterwards:
            back()

    return ShardedModel(engine, pipeline, holding, buffers, after_fit)


def _check_not_sharded_elsewhere(model: nn.Module, config: ZeroConfig) -> None:
    """A stage-3 run converts the module (or its pipeline stages) in place, to FSDP2's DTensor shards and hooks, and
    leaves it so, as FSDP and DeepSpeed's stage 3 do: only another stage-3 run can take it up."""
    if config.shards_parameters or not any(isinstance(p, DTensor) for p in model.parameters()):
        return
    name = type(model).__name__.removeprefix("FSDP") if isinstance(model, FSDPModule) else type(model).__name__
    raise ZeroConfigError(
        f"{name} was sharded in place by an earlier `ZeroStrategy(stage=3)` run (its parameters are "
        f"DTensor shards), which this run at stage={config.stage} cannot take up. "
        "Run it at `stage=3` again, or load the checkpoint that run saved into a new module "
        f"(`lightning_zero.load_from_checkpoint({name}, path)`, or a new module and `fit(..., ckpt_path=path)`)."
    )


def _in_the_shards_form(model: nn.Module, fitting: bool, afterwards: list[Callable[[], None]]) -> None:
    """Row-major parameters and, for training, dense embedding gradients (see [Note: the memory the row shards
    need] in ``engine/row_major.py``), each said once."""
    if moved := store_row_major(model):
        rank_zero_info(
            f"ZeroStrategy stores {_listed(moved)} row-major (contiguous): it shards parameters by rows, "
            "as DeepSpeed and FSDP flatten them. Channels-last inputs still run channels-last kernels."
        )
    if fitting:
        densified, back = dense_embedding_gradients(model)
        if densified:
            rank_zero_info(
                f"ZeroStrategy trains the embeddings {_listed(densified)} with dense gradients "
                "(`sparse=False`; it shards dense gradients) and turns `sparse` back on after fit."
            )
            afterwards.append(back)


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def compression_spec(config: ZeroConfig) -> CompressionSpec | None:
    """The engines' view of the compression settings (``engine/comm/compression.py``); None when nothing is compressed."""
    if not config.compresses:
        return None
    return CompressionSpec(
        gradients=config.gradient_compression,
        params=config.param_compression,
        scheme=config.quantization_scheme,
        block_size=config.quantization_block_size,
        error_feedback=config.error_feedback,
        inter_node_only=config.compression_scope == "inter_node",
    )


def selective_settings(config: ZeroConfig) -> SelectiveSettings | None:
    """The engine's view of selective updates (``engine/offload/selective.py``); None with ``offload_update_interval=1``."""
    if (
        config.offload_update_interval == 1
        or config.offload_topk_ratio is None
        or config.offload_select_interval is None
    ):
        return None
    return SelectiveSettings(
        config.offload_update_interval,
        config.offload_topk_ratio,
        config.offload_select_interval,
        config.offload_overlap_step,
    )
