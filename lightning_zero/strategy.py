"""ZeroStrategy: Lightning hook wiring for ZeRO stages 1-3. The sharding itself lives in ``engine/``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer, _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import checkpoint_io, checkpoint_write, hf_export
from lightning_zero.activation_checkpointing import apply_activation_checkpointing, resolve_policy
from lightning_zero.checkpoint_async import AsyncSaver, checkpoint_group
from lightning_zero.checkpoint_files import clean_directory, remove
from lightning_zero.config import (
    ModulePolicy,
    PipelineSchedule,
    PipelineSplit,
    REGISTERED_STRATEGIES,
    StartMethod,
    StateDictType,
    ZeroConfig,
    ZeroConfigError,
)
from lightning_zero.deepspeed_config import (
    DeepSpeedSettings,
    apply_to_trainer,
    check_batch_sizes,
    merge_strategy_arguments,
    optimizers_from_config,
    parse_deepspeed_config,
    precision_plugin_for,
)
from lightning_zero.engine import collectives
from lightning_zero.engine.api import ShardingEngine
from lightning_zero.engine.fsdp2 import FullyShardedEngine
from lightning_zero.engine.layout import check_trainable
from lightning_zero.engine.offload import should_pin
from lightning_zero.engine.state_dict import gather_full
from lightning_zero.engine.zero_dp import ZeroDataParallel
from lightning_zero.fault_handling import FaultHandling
from lightning_zero.faults.timeouts import extended_during, long_timeout
from lightning_zero.launcher import ZeroMultiProcessingLauncher, ZeroScriptLauncher
from lightning_zero.pipeline.parallel import PipelineParallel
from lightning_zero.pipeline.split import PipelineLayout
from lightning_zero.precision import ZeroPrecision, as_zero_precision
from lightning_zero.pretrained import load_pretrained
from lightning_zero.resume import ResumeState
from lightning_zero.rng import collect_rng_state


class ZeroStrategy(ParallelStrategy):
    """ZeRO data parallelism for any LightningModule.

    Stage 1 shards optimizer state, stage 2 also gradients, stage 3 also parameters (over FSDP2). Every
    setting is validated here, on every rank, before any process group exists.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        *,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        pin_memory: bool | None = None,
        activation_checkpointing: Any = None,
        wrap_policy: ModulePolicy = None,
        pipeline_stages: int = 1,
        microbatches: int | None = None,
        pipeline_schedule: PipelineSchedule = "1f1b",
        pipeline_split: PipelineSplit = "layers",
        pipeline_virtual_stages: int | None = None,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        reduce_every_microbatch: bool = False,
        elementwise_optimizers: tuple[type, ...] = (),
        init_weights: str | Path | None = None,
        init_weights_strict: bool = True,
        init_weights_prefix: str | None = None,
        gather_16bit_weights_on_save: bool = False,
        async_save: bool = False,
        state_dict_type: StateDictType = "sharded",
        config: dict | str | Path | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(seconds=60),
        watchdog: bool = True,
        start_method: StartMethod = "popen",
        auto_resume: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        #: A DeepSpeed-style config, checked now; its Trainer-level parts apply when a Trainer runs.
        self._deepspeed = parse_deepspeed_config(config) if config is not None else None
        arguments = dict(
            stage=stage,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            pin_memory=pin_memory,
            activation_checkpointing=activation_checkpointing,
            wrap_policy=wrap_policy,
            pipeline_stages=pipeline_stages,
            microbatches=microbatches,
            pipeline_schedule=pipeline_schedule,
            pipeline_split=pipeline_split,
            pipeline_virtual_stages=pipeline_virtual_stages,
            bucket_size_mb=bucket_size_mb,
            overlap_comm=overlap_comm,
            reduce_every_microbatch=reduce_every_microbatch,
            elementwise_optimizers=tuple(elementwise_optimizers),
            init_weights=init_weights,
            init_weights_strict=init_weights_strict,
            init_weights_prefix=init_weights_prefix,
            gather_16bit_weights_on_save=gather_16bit_weights_on_save,
            async_save=async_save,
            state_dict_type=state_dict_type,
            process_group_backend=process_group_backend,
            timeout=timeout,
            watchdog=watchdog,
            start_method=start_method,
            auto_resume=auto_resume,
        )
        if self._deepspeed is not None:
            defaults = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
            arguments = merge_strategy_arguments(self._deepspeed, arguments, defaults)
        self.zero_config = ZeroConfig(**arguments)
        #: The resolved ``activation_checkpointing`` (None: off); resolved here so a bad policy fails at once.
        self.checkpoint_policy = resolve_policy(self.zero_config.activation_checkpointing)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._engine: ShardingEngine | None = None
        self._pipeline: PipelineParallel | None = None
        self._buffers: list[Tensor] = []
        self._failed = False
        self._faults = FaultHandling()  # watchdog, timeouts, SIGTERM, first failure (fault_handling.py)
        self._resume = ResumeState()  # auto-resume, exact mid-epoch resume, the SIGTERM checkpoint (resume/)
        self._saver: AsyncSaver | None = None  # async_save: exists from setup to teardown of a fit

    @property
    def deepspeed_settings(self) -> DeepSpeedSettings | None:
        """What ``config=`` asked for beyond the strategy's own arguments (precision, Trainer, optimizer)."""
        return self._deepspeed

    # ------------------------------------------------------------------ properties
    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def engine(self) -> ShardingEngine | None:
        """The sharding engine (exists after ``setup``)."""
        return self._engine

    @property
    def pipeline(self) -> PipelineParallel | None:
        """This rank's pipeline stages (exists after ``setup`` when ``pipeline_stages > 1``)."""
        return self._pipeline

    @property
    @override
    def root_device(self) -> torch.device:
        _require(self.parallel_devices, "parallel_devices")
        return self.parallel_devices[self.local_rank]

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
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._pipeline is not None:
            return self._pipeline.sampler_kwargs(self.global_rank)
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self.zero_config.process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizer state is restored into shards, which exist only after `setup`.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        if precision_plugin is not None and precision_plugin is self._precision_plugin:
            return  # Lightning hands back the plugin this strategy chose
        self._precision_plugin = as_zero_precision(precision_plugin_for(getattr(self, "_deepspeed", None), precision_plugin))

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        _require(self.cluster_environment, "cluster_environment")
        if (config := self.zero_config).pipeline_stages > 1:  # before any process starts: devices x nodes must divide
            PipelineLayout(self.num_nodes * self.num_processes, config.pipeline_stages, config.pipeline_virtual)
        if self.zero_config.start_method == "popen":
            # Under torchrun/SLURM too (it then starts nothing): it resolves `ckpt_path` (auto-resume, "last").
            self._launcher = ZeroScriptLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ZeroMultiProcessingLauncher(self, start_method=self.zero_config.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self.zero_config.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _require(self.cluster_environment, "cluster_environment")
        # A slow start is not a hang: `timeout` applies once the loops run (see faults/timeouts.py).
        _init_dist_connection(self.cluster_environment, backend, timeout=long_timeout(self.zero_config.timeout))
        self._faults.start(self.zero_config, self.global_rank, self.world_size)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._resume.on_exception(_trainer_of(self.lightning_module), exception)  # the SIGTERM checkpoint
        self._failed = True  # teardown must not start collectives a failed peer never joins
        self._faults.on_exception(exception)  # names the cause on every rank (faults/watchdog.py)

    # ------------------------------------------------------------------ model and optimizers
    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3 builds ``configure_model`` on the meta device; shards are materialised one unit at a time."""
        with torch.device("meta") if self.stage == 3 else contextlib.nullcontext():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._resume.check_agreement()  # auto-resume: every rank loads the same checkpoint (collective)
        _require(self.accelerator, "accelerator")
        _require(self.model, "model")
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        apply_to_trainer(self._deepspeed, trainer)
        self._engine = self._pipeline = None  # never reuse an earlier run's (it may belong to another module)
        self._failed = False
        precision = self.precision_plugin
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = precision.convert_module(self.model)
        if fitting:
            check_trainable(self.model)
        if self.checkpoint_policy is not None:
            # Before sharding: FSDP2 then re-gathers parameters for the recomputation like for any backward.
            apply_activation_checkpointing(self.model, self.checkpoint_policy)
        config = self.zero_config
        pin = should_pin(self.root_device, config.pin_memory) if config.optimizer_on_host else False
        if self.stage == 3:
            self._engine = FullyShardedEngine(
                self.model,
                device=self.root_device,
                wrap_policy=config.wrap_policy,
                policy=precision.policy(),
                offload_optimizer=fitting and config.offload_optimizer,
                offload_params=config.offload_params,
                pin_memory=pin,
            )
        else:
            group, source, mesh = None, 0, None
            if config.pipeline_stages > 1:
                if self._layer_sync:
                    raise ZeroConfigError("`sync_batchnorm=True` is not supported with `pipeline_stages > 1`.")
                self._pipeline = PipelineParallel(self.model, config, self.global_rank, self.world_size, self.root_device)
                group, source, mesh = self._pipeline.dp_group, self._pipeline.dp_source, self._pipeline.dp_mesh
            else:
                self.model_to_device()
            held = [t.data for t in (*self.model.parameters(), *self.model.buffers()) if not t.is_meta]
            collectives.broadcast(held, src=source, group=group)
            if fitting:
                self._engine = ZeroDataParallel(
                    self.model,
                    stage=self.stage,
                    bucket_numel=config.bucket_numel,
                    overlap_comm=config.overlap_comm,
                    policy=precision.policy(),
                    offload_optimizer=config.offload_optimizer,
                    pin_memory=pin,
                    group=group,
                    mesh=mesh,
                )
        if config.init_weights is not None:
            load_pretrained(self.model, config.init_weights, strict=config.init_weights_strict,
                            prefix=config.init_weights_prefix, engine=self._engine)
        self._buffers = [b for b in self.model.buffers() if not b.is_meta]
        if fitting:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                self._engine.wrap_optimizer(_unwrap(optimizer), self.zero_config.elementwise_optimizers)
        self.setup_precision_plugin()
        precision.attach(self._engine, self.root_device)
        if fitting and not config.optimizer_on_host:
            _optimizers_to_device(self.optimizers, self.root_device)
        if fitting:
            self._setup_checkpoints(trainer)

    def _setup_checkpoints(self, trainer: pl.Trainer) -> None:
        """Rank 0 removes what interrupted saves left in the ModelCheckpoint directories (temporaries only, see
        ``checkpoint_files.py``); with ``async_save`` every rank starts its background writer."""
        if self.is_global_zero:
            for callback in trainer.checkpoint_callbacks:
                if isinstance(getattr(callback, "dirpath", None), (str, Path)):
                    clean_directory(Path(callback.dirpath))
        if self.zero_config.async_save:
            self._saver = AsyncSaver(checkpoint_group(self.zero_config.timeout), self.zero_config.timeout)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """As Lightning's, or from the DeepSpeed config's ``optimizer``/``scheduler`` sections when
        ``configure_optimizers`` returns None (as with Lightning's DeepSpeed strategy); both at once is an error."""
        settings = self._deepspeed
        if settings is None or (settings.optimizer is None and settings.scheduler is None):
            return super().setup_optimizers(trainer)
        module = self.lightning_module
        self.optimizers, self.lr_scheduler_configs = optimizers_from_config(
            settings, module, trainer, lambda: _init_optimizers_and_lr_schedulers(module)
        )

    @override
    def on_train_start(self) -> None:
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            check_batch_sizes(self._deepspeed, module.trainer)
        self._activate_fault_handling()
        self._resume.on_train_start()  # a resumed fit's RNG state, right before its first batch

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """After a mid-epoch restore the train DataLoader continues its epoch where the checkpoint left it."""
        return self._resume.process_dataloader(dataloader, _trainer_of(self.lightning_module))

    @override
    def model_to_device(self) -> None:
        _require(self.model, "model")
        self.model.to(self.root_device)

    @override
    def on_train_end(self) -> None:
        self.wait_for_checkpoint()  # fit returns with its last checkpoint complete, or raises its failure everywhere

    def _activate_fault_handling(self) -> None:
        trainer = _trainer_of(self.lightning_module)
        if trainer is not None:
            self._faults.activate(trainer, self._engine is not None and self._engine.shards_module_in_place)

    @override
    def teardown(self) -> None:
        # First the exit agreement: a rank that finished while a peer still waits must fail, not report success.
        error = self._faults.finish(succeeded=not self._failed)
        self._failed = self._failed or error is not None
        saver, self._saver = self._saver, None
        if saver is not None:  # normally idle (on_train_end waited); after a failure, without collectives
            saver.close(agree=not self._failed)
        module = self.lightning_module
        fitted = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if self._engine is not None:
            if fitted and not self._failed:
                self._engine.restore_master_params()
            self._engine.teardown()
        if fitted and self._layer_sync and not (self._engine is not None and self._engine.shards_module_in_place):
            self.model = self._layer_sync.revert(self.model)  # give the user back their BatchNorm layers, as DDP
        _require(self.cluster_environment, "cluster_environment")
        _require(self.accelerator, "accelerator")
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        if error is not None:
            raise error

    # ------------------------------------------------------------------ steps
    def _call_module(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Stage 3's root is the LightningModule itself: route the step through its ``__call__`` so FSDP2's
        root hooks (unshard, lazy init, reshard) run around it."""
        module = self.lightning_module
        _require(module, "lightning_module")
        if self._engine is not None and self._engine.shards_module_in_place:
            return self._forward_redirection(module, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    def _sync_buffers(self) -> None:
        """As DDP's ``broadcast_buffers=True``: rank 0's buffers (e.g. BatchNorm running statistics) before every
        training step and before evaluation, so results and checkpoints agree whichever rank they come from.
        Never per evaluation step: prediction may give ranks different numbers of batches."""
        if self._buffers:
            # Under pipeline stages, each stage's replicas hold that stage's buffers.
            group, source = (self._pipeline.dp_group, self._pipeline.dp_source) if self._pipeline else (None, 0)
            collectives.broadcast(self._buffers, src=source, group=group)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Automatic optimization zeroes gradients at the first micro-batch of every accumulation window;
        reduced shards live outside ``p.grad`` (stage 2), so drop them here too. Otherwise a window whose
        step was skipped (e.g. an ``optimizer_step`` override that only runs the closure) would leak its
        gradients into the next one."""
        module = self.lightning_module
        trainer = module.trainer if module is not None and module._trainer is not None else None
        if trainer is not None:
            self._resume.on_train_batch_start(trainer, batch_idx)
        if self._engine is not None and trainer is not None and module.automatic_optimization:
            if batch_idx % trainer.accumulate_grad_batches == 0:
                self._engine.discard_all_gradients()

    @override
    def on_validation_start(self) -> None:
        self._activate_fault_handling()
        self._sync_buffers()

    @override
    def on_test_start(self) -> None:
        self._activate_fault_handling()
        self._sync_buffers()

    @override
    def on_predict_start(self) -> None:
        self._activate_fault_handling()
        self._sync_buffers()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._faults.mark("train", args, kwargs)  # step marks: see engine/flight.py
        self._sync_buffers()
        with self.precision_plugin.train_step_context():
            if self._pipeline is None:
                return self._call_module("training_step", *args, **kwargs)
            # The schedule runs forward, loss and backward here; `backward` then hands the gradients on.
            scale = self.precision_plugin.loss_scale / self.lightning_module.trainer.accumulate_grad_batches
            return self._pipeline.training_step(_batch(args, kwargs), scale, self._engine)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._faults.mark("val", args, kwargs)
        with self.precision_plugin.val_step_context():
            if self._pipeline is not None:
                return self._pipeline.evaluation_step("val", _batch(args, kwargs))
            return self._call_module("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._faults.mark("test", args, kwargs)
        with self.precision_plugin.test_step_context():
            if self._pipeline is not None:
                return self._pipeline.evaluation_step("test", _batch(args, kwargs))
            return self._call_module("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._faults.mark("predict", args, kwargs)
        if self._pipeline is not None:
            raise ZeroConfigError("`predict` is not available with `pipeline_stages > 1` (only the last stage sees the "
                                  "outputs): load the checkpoint into a run without pipelining to predict.")
        with self.precision_plugin.predict_step_context():
            return self._call_module("predict_step", *args, **kwargs)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: no gradient communication."""
        if self._engine is None or self.zero_config.reduce_every_microbatch:
            yield
            return
        with self._engine.no_sync():
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """As Lightning's, but the reduced gradient shards land before ``on_after_backward`` runs, so hooks
        (and memory probes) see the state a step will use."""
        module = self.lightning_module
        _require(module, "lightning_module")
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._pipeline is not None:
            self._pipeline.restore_gradients()  # the schedule ran backward inside `training_step`
        else:
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if self._engine is not None:
            self._engine.post_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def gather_gradients(self, optimizer: Optimizer | None = None) -> dict[str, Tensor]:
        """Full (unsharded) gradients by parameter name, on every rank. Collective; for debugging and tests:
        call it where gradients are final, e.g. in ``on_before_optimizer_step``."""
        if self._engine is None:
            raise RuntimeError("gather_gradients() needs a fitted ZeroStrategy (call it during `fit`).")
        optimizers = [optimizer] if optimizer is not None else self.optimizers
        out: dict[str, Tensor] = {}
        for opt in optimizers:
            opt = _unwrap(opt)
            self.precision_plugin.finalize_gradients(opt)
            for record in self._engine.optimizer_shards(opt).records():
                if (local := record.grad) is not None:
                    out[record.name] = gather_full(local, record.shape, group=record.group)
        if self._pipeline is not None:  # each stage's ranks gathered that stage's gradients
            out = {k: v for part in collectives.all_gather_objects(out) for k, v in part.items()}
        return out

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
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Reduce a tensor over ranks (``self.log(..., sync_dist=True)`` and metrics come through here)."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        op, divide = collectives.reduce_op_from_name(reduce_op)
        out = tensor.detach().clone() if tensor.requires_grad else tensor.clone()
        if not out.is_floating_point() and divide:
            out = out.float()
        collectives.all_reduce(out, op=op, group=group)
        return out / self.world_size if divide else out

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> dict[str, Tensor]:
        """The module's unsharded ``state_dict`` on rank 0 (empty elsewhere), trainable parameters at the
        precision the optimizer updates them in. Collective."""
        _require(self.lightning_module, "lightning_module")
        return checkpoint_io.full_model_state(self.lightning_module, self._engine)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        _require(self.lightning_module, "lightning_module")
        if self.zero_config.state_dict_type == "full":
            return self.full_state_dict()
        return checkpoint_io.sharded_model_state(self.lightning_module, self._engine)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = _unwrap(optimizer)
        if self.zero_config.state_dict_type == "full":
            return checkpoint_io.full_optimizer_state(optimizer, self.lightning_module, self._engine)
        return checkpoint_io.sharded_optimizer_state(optimizer, self.lightning_module, self._engine)

    @override
    @extended_during("saving a checkpoint")  # rank 0 may write alone while the others wait (faults/timeouts.py)
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint(storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        checkpoint["rng_states"] = collectives.all_gather_objects(collect_rng_state())
        self._resume.on_save(checkpoint, _trainer_of(self.lightning_module))  # what a resume replays (resume/state.py)
        hf_model = hf_export.describe(self.lightning_module) if self.lightning_module is not None else None
        if hf_model is not None:
            checkpoint["hf_export"] = hf_model  # what `lightning-zero consolidate --hf` needs
        if self.zero_config.state_dict_type == "full":
            checkpoint_write.save_full(checkpoint, path)  # rank 0 writes; every rank raises if that failed
        elif self._saver is not None:
            self._saver.save(checkpoint, path)  # returns once staged; the next save or teardown waits for it
        else:
            checkpoint_write.save_sharded(checkpoint, path)
        if self.zero_config.gather_16bit_weights_on_save:
            state = self.full_state_dict()
            if self.is_global_zero:
                dtype = self.precision_plugin.compute_dtype if isinstance(self.precision_plugin, ZeroPrecision) else None
                hf_export.save_16bit(state, hf_model, path, dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
            self.barrier()

    def wait_for_checkpoint(self) -> None:
        """With ``async_save``: block until the save in flight (if any) is complete, and raise its failure on
        every rank. Collective. Fit already waits at each save and when training ends."""
        if self._saver is not None:
            self._saver.wait()

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            # async_save: once the save in flight has succeeded (never the newest complete checkpoint)
            removal = self._saver.remove if self._saver is not None else remove
            for path in (Path(filepath), hf_export.sixteen_bit_dir(filepath)):
                removal(path)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        _require(self.lightning_module, "lightning_module")
        checkpoint = checkpoint_io.load(
            path,
            self.lightning_module,
            [_unwrap(o) for o in self.optimizers],
            self._engine,
            strict=self.lightning_module.strict_loading,
            weights_only=True if weights_only is None else weights_only,
        )
        states = checkpoint.get("rng_states")
        # Put back later in a fit, where the uninterrupted run was: [Note: when the RNG state is restored].
        self._resume.loaded(checkpoint, _trainer_of(self.lightning_module), states[self.global_rank % len(states)] if states else None)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        _require(self.lightning_module, "lightning_module")
        checkpoint_io.load_model_state(self.lightning_module, checkpoint["state_dict"], self._engine, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            checkpoint_io.load_optimizer_state(_unwrap(optimizer), state, self.lightning_module, self._engine)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, kwargs in REGISTERED_STRATEGIES.items():
            strategy_registry.register(name, cls, description=f"ZeroStrategy({kwargs})", **kwargs)


def _require(value: Any, what: str) -> None:
    """Lightning sets these up before calling the hook that needs them; say which one is missing if not."""
    if value is None:
        raise RuntimeError(f"ZeroStrategy needs `{what}`, which Lightning has not set up yet; use it through a Trainer.")


def _trainer_of(module: pl.LightningModule | None) -> pl.Trainer | None:
    return module.trainer if module is not None and module._trainer is not None else None


def _unwrap(optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _batch(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs["batch"]
