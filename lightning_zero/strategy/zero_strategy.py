"""ZeroStrategy: Lightning's ``Trainer`` hooks over ZeRO stages 1-3.

It holds collaborators that take no ``Trainer`` (a Fabric strategy can hold the same ones):
:class:`~lightning_zero.strategy.processes.DistributedProcesses` (the process group, faults),
:class:`~lightning_zero.strategy.checkpoints.ShardedCheckpoints` (saving and loading) and the
:class:`~lightning_zero.strategy.sharding.ShardedModel` that ``sharding.shard_model`` makes in ``setup``; the
sharding itself lives in ``engine/`` behind ``engine/api.py``. What only a ``Trainer`` has (its state, callbacks,
loops, launchers) stays here.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.activation_checkpointing import ActivationOffload, activation_offload, resolve_policy
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.compression import Compression, CompressionScope, QuantizationScheme
from lightning_zero.config.zero_config import (
    REGISTERED_STRATEGIES,
    ModulePolicy,
    OptimizerStateDtype,
    PipelineSchedule,
    PipelineSplit,
    ShardSize,
    Stage,
    StartMethod,
    StateDictType,
)
from lightning_zero.deepspeed_compat.config import CONFIG_DEFAULTS, strategy_settings
from lightning_zero.deepspeed_compat.trainer import (
    apply_to_trainer,
    check_batch_sizes,
    optimizers_from_config,
    precision_plugin_for,
)
from lightning_zero.engine.comm import collectives
from lightning_zero.faults.timeouts import extended_during
from lightning_zero.pipeline.parallel import PipelineParallel
from lightning_zero.pipeline.split import pipeline_layout
from lightning_zero.planning.auto import AutoChoice
from lightning_zero.precision.zero_precision import ZeroPrecision, as_zero_precision
from lightning_zero.resume import ResumeState
from lightning_zero.resume.rng import collect_rng_state
from lightning_zero.sequence_parallel import SequenceParallel
from lightning_zero.sequence_parallel.attention import AttentionInterception
from lightning_zero.sequence_parallel.causal_lm import SequenceParallelWiring
from lightning_zero.sequence_parallel.parallel import activate
from lightning_zero.strategy import processes
from lightning_zero.strategy.auto_choice import CHECKPOINT_KEY as AUTO_CHECKPOINT_KEY
from lightning_zero.strategy.auto_choice import AutoChoosing, FirstStepsPeak, records_given_arguments
from lightning_zero.strategy.averaging_checkpoints import average_to_load, keep_averages_in_checkpoints
from lightning_zero.strategy.callback_support import may_change_gradients, refuse_unsupported_callbacks
from lightning_zero.strategy.checkpoints import unwrap
from lightning_zero.strategy.core import StrategyCore
from lightning_zero.strategy.evaluation_loops import evaluate_under_no_grad
from lightning_zero.strategy.launcher import ZeroMultiProcessingLauncher, ZeroScriptLauncher
from lightning_zero.strategy.micro_batches import SplitStep
from lightning_zero.strategy.processes import require
from lightning_zero.strategy.sharding import NOT_SHARDED, ShardedModel, construction_device, shard_model
from lightning_zero.strategy.step_redirection import RootHeldRedirection
from lightning_zero.strategy.swa import average_sharded_weights, clear_schedulers_for_swa

#: The strategies set up in this process, for what is handed only a module (``gradient_norms.grad_norm``).
RUNNING: weakref.WeakSet[ZeroStrategy] = weakref.WeakSet()


class ZeroStrategy(StrategyCore, ParallelStrategy):
    """ZeRO data parallelism for any LightningModule.

    Stage 1 shards optimizer state, stage 2 also gradients, stage 3 also parameters (over FSDP2). Every
    setting is validated here, on every rank, before any process group exists.
    """

    strategy_name = "zero"
    #: Inside a non-final micro-batch of gradient accumulation (``block_backward_sync``); ``partial_gradients``: the
    #: last backward was one, and left this rank's sums unreduced until the window's last micro-batch.
    _accumulating = partial_gradients = False

    @records_given_arguments
    def __init__(
        self,
        stage: Stage = 2,
        *,
        device_memory: int | str | None = None,
        memory_headroom: float = 0.1,
        offload_optimizer: bool | float = False,
        offload_params: bool = False,
        offload_step_delay: int = 0,
        optimizer_state_dtype: OptimizerStateDtype = "fp32",
        offload_update_interval: int = 1,
        offload_topk_ratio: float | None = None,
        offload_select_interval: int | None = None,
        offload_overlap_step: bool = True,
        pin_memory: bool | None = None,
        activation_checkpointing: Any = None,
        offload_activations: bool = False,
        tiled_compute: bool = False,
        sequence_parallel_size: int = 1,
        wrap_policy: ModulePolicy = None,
        pipeline_stages: int = 1,
        microbatches: int | None = None,
        pipeline_schedule: PipelineSchedule = "1f1b",
        pipeline_split: PipelineSplit = "layers",
        pipeline_virtual_stages: int | None = None,
        shard_size: ShardSize = None,
        secondary_shard_size: ShardSize = None,
        bucket_size_mb: float = 25.0,
        unit_size_mb: float = 100.0,
        overlap_comm: bool = True,
        reduce_every_microbatch: bool = False,
        compile: bool | dict = False,
        gradient_compression: Compression | None = None,
        param_compression: Compression | None = None,
        quantization_scheme: QuantizationScheme = "symmetric",
        quantization_block_size: int = 2048,
        error_feedback: bool = False,
        compression_scope: CompressionScope = "all",
        elementwise_optimizers: tuple[type, ...] = (),
        matrix_optimizers: tuple[type, ...] = (),
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
        arguments = {name: value for name, value in locals().items() if name in CONFIG_DEFAULTS}
        #: ``self._deepspeed``: a DeepSpeed-style config, checked now; its Trainer-level parts apply when a Trainer runs.
        self._hold(*strategy_settings(arguments, config))  # the settings and the collaborators (core.py)
        #: ``stage="auto"``: the planner's choice, made when fit starts ([Note: when zero_auto chooses]).
        self._auto = None if self.zero_config.chosen else AutoChoosing(self.zero_config, self._given())
        self._first_steps: FirstStepsPeak | None = None
        self._split_step: SplitStep | None = None  # a split batch's parts waiting for `backward`
        self._num_nodes = 1
        #: The last fit's sharding and module, while the trainer's optimizers are that fit's (``_states``).
        self._fitted: tuple[ShardedModel, torch.nn.Module] | None = None
        self._resume = ResumeState()  # auto-resume, exact mid-epoch resume, the SIGTERM checkpoint (resume/)
        #: With ``sequence_parallel_size > 1`` (from ``setup``): this rank's group, the batch's cut, the wired models.
        self._sequence: SequenceParallel | None = None
        self._sequence_wiring: SequenceParallelWiring | None = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._forward_redirection = RootHeldRedirection(self)

    def _given(self) -> set[str]:
        """The settings given (the constructor's arguments, and what a DeepSpeed ``config`` sets)."""
        given = set(getattr(self, "_given_arguments", ()))
        if self._deepspeed is not None:
            given |= set(self._deepspeed.strategy)
        return given

    # ------------------------------------------------------------------ properties
    @property
    def auto_choice(self) -> AutoChoice | None:
        """With ``stage="auto"``: what the planner chose (settings, micro-batch, predicted peak, the table it printed),
        once ``fit`` has started; None otherwise."""
        return self._auto.choice if self._auto is not None else None

    @property
    def auto_measured_peak(self) -> int | None:
        """With ``stage="auto"``: the largest measured peak over the ranks of the fit's second optimizer step (see
        :class:`~lightning_zero.strategy.auto_choice.FirstStepsPeak`), once measured."""
        return max(self._first_steps.peaks) if self._first_steps is not None and self._first_steps.peaks else None

    @property
    def activation_offload(self) -> ActivationOffload | None:
        """With ``offload_activations=True``, the host tier of the checkpointed inputs: its ``statistics`` say the
        bytes moved each way and held on the host. None otherwise."""
        return activation_offload(self.lightning_module) if self.lightning_module is not None else None

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

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizer state is restored into shards, which exist only after `setup`.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        """This rank's sequence-parallel group (exists after ``setup`` when ``sequence_parallel_size > 1``)."""
        return self._sequence

    @property
    def pipeline(self) -> PipelineParallel | None:
        """This rank's pipeline stages (exists after ``setup`` when ``pipeline_stages > 1``)."""
        return self._sharded.pipeline

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.pipeline is not None:
            return self.pipeline.sampler_kwargs(self.global_rank)
        if (size := self.zero_config.sequence_parallel_size) > 1:  # a group's ranks read the same samples
            return {"num_replicas": self.num_nodes * self.num_processes // size, "rank": self.global_rank // size}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    @override
    def precision_plugin(self) -> ZeroPrecision:
        plugin = self._precision_plugin
        if not isinstance(plugin, ZeroPrecision):  # None until one is chosen: the setter converts every other
            plugin = self._precision_plugin = ZeroPrecision()
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        if precision_plugin is not None and precision_plugin is self._precision_plugin:
            return  # Lightning hands back the plugin this strategy chose
        self._precision_plugin = as_zero_precision(
            precision_plugin_for(getattr(self, "_deepspeed", None), precision_plugin)
        )

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        environment = require(self.cluster_environment, "cluster_environment")
        if (config := self.zero_config).pipeline_stages > 1:  # before any process starts: devices x nodes must divide
            pipeline_layout(config, self.num_nodes * self.num_processes)
        world_size = processes.cluster_world_size(environment, self.num_nodes, self.num_processes)
        config.group_sizes(world_size, self.num_processes)  # shard_size / hpZ fit the cluster
        if world_size % config.sequence_parallel_size:
            raise ZeroConfigError(
                f"`sequence_parallel_size={config.sequence_parallel_size}` must divide the number of processes "
                f"({world_size}): each sample is shared by that many ranks."
            )
        if config.start_method == "popen":
            # Under torchrun/SLURM too (it then starts nothing): it resolves `ckpt_path` (auto-resume, "last").
            self._launcher = ZeroScriptLauncher(self, environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ZeroMultiProcessingLauncher(self, start_method=config.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        environment = require(self.cluster_environment, "cluster_environment")
        self._processes.start(environment, self.root_device, self.global_rank, self.world_size, self.num_processes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Both functions carry the rank as an attribute Lightning sets at run time, undeclared.
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._resume.on_exception(trainer_of(self.lightning_module), exception)  # the SIGTERM checkpoint
        self._processes.on_exception(exception)

    @override
    def barrier(self, name: str | None = None) -> None:
        processes.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return processes.broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """Reduce a tensor over ranks (``self.log(..., sync_dist=True)`` and metrics come through here)."""
        return processes.reduce(tensor, group, reduce_op, self.world_size)

    # ------------------------------------------------------------------ model and optimizers
    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3 builds ``configure_model`` on the meta device; shards are materialised one unit at a time."""
        self._choose_if_auto()
        with construction_device(self.zero_config):
            yield

    def _choose_if_auto(self) -> None:
        """``stage="auto"``: choose (or take the choice made before) and hold it as the settings."""
        if self._auto is None or self.zero_config.chosen:
            return
        module = require(self.lightning_module, "lightning_module")
        trainer = trainer_of(module)
        with torch.device("cpu"):  # inside Lightning's `tensor_init_context` the default device is the accelerator
            if self._auto.choice is None:
                self._auto.choose(self, require(trainer, "trainer"), module)
            self.zero_config = self._auto.chosen_config(module)
        self.checkpoint_policy = resolve_policy(
            self.zero_config.activation_checkpointing, self.zero_config.offload_activations
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._choose_if_auto()
        refuse_unsupported_callbacks(trainer, self.zero_config)
        self._resume.check_agreement()  # auto-resume: every rank loads the same checkpoint (collective)
        require(self.accelerator, "accelerator").setup(trainer)
        model = require(self.model, "model")
        fitting = trainer.state.fn == TrainerFn.FITTING
        apply_to_trainer(self._deepspeed, trainer)
        evaluate_under_no_grad(trainer)
        self._sharded = NOT_SHARDED  # never reuse an earlier run's (another module's, maybe)
        self._processes.failed = False
        RUNNING.add(self)
        precision = self.precision_plugin
        if (size := self.zero_config.sequence_parallel_size) > 1:
            self._sequence = SequenceParallel.across(size, self.global_rank, self.world_size, self.root_device)
            self._sequence_wiring = SequenceParallelWiring(model, size)
        if fitting and self._layer_sync:
            model = self._layer_sync.apply(model)
        self.model = model = precision.convert_module(model)
        self._sharded = shard_model(
            model,
            self.zero_config,
            policy=precision.policy(),
            checkpoint_policy=self.checkpoint_policy,
            fitting=fitting,
            rank=self.global_rank,
            world_size=self.world_size,
            node_size=self.num_processes,
            device=self.root_device,
            move_to_device=self.model_to_device,
            sync_batchnorm=bool(self._layer_sync),
        )
        if fitting:
            self.setup_optimizers(trainer)
            engine = require(self.engine, "engine")
            for optimizer in self.optimizers:
                config = self.zero_config
                engine.wrap_optimizer(unwrap(optimizer), config.elementwise_optimizers, config.matrix_optimizers)
        self.setup_precision_plugin()  # makes Lightning's optimizer wrappers again
        precision.attach(self.engine, self.root_device)
        if fitting and not self.zero_config.optimizer_on_host:
            _optimizers_to_device(self.optimizers, self.root_device)
        if fitting:
            for wrapper in self._lightning_optimizers:  # `opt.zero_grad()` in manual optimization: the engine's, if any
                setattr(wrapper, "zero_grad", unwrap(wrapper).zero_grad)
            directories = [getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks]
            self._checkpoints.open([Path(d) for d in directories if isinstance(d, (str, Path))], self.is_global_zero)
            self._fitted = (self._sharded, require(self.lightning_module, "lightning_module"))
            keep_averages_in_checkpoints(trainer, self._full_checkpoints, self._held, self.load_model_state_dict)
            if self.auto_choice is not None and self._first_steps is None and trainer.global_step == 0:
                self._first_steps = FirstStepsPeak(self.auto_choice)
                trainer.callbacks.append(self._first_steps)  # type: ignore[attr-defined]  # Lightning's, undeclared
            sharded = self._sharded
            average_sharded_weights(
                trainer,
                require(self.lightning_module, "lightning_module"),
                sharded.engine,
                sharded.holding,
                sharded.sync_buffers,
            )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """As Lightning's, or from the DeepSpeed config's ``optimizer``/``scheduler`` sections when
        ``configure_optimizers`` returns None (as with Lightning's DeepSpeed strategy); both at once is an error."""
        settings = self._deepspeed
        if settings is None or (settings.optimizer is None and settings.scheduler is None):
            return super().setup_optimizers(trainer)
        module = require(self.lightning_module, "lightning_module")
        self.optimizers, self.lr_scheduler_configs = optimizers_from_config(
            settings, module, trainer, lambda: _init_optimizers_and_lr_schedulers(module)
        )

    @override
    def model_to_device(self) -> None:
        require(self.model, "model").to(self.root_device)

    @override
    def teardown(self) -> None:
        RUNNING.discard(self)
        self._split_step = None
        trainer = trainer_of(self.lightning_module)
        callbacks = getattr(trainer, "callbacks", [])
        if self._first_steps is not None:
            self._first_steps.close()  # Lightning's callback teardown comes after this one: a run stopped early
            if self._first_steps in callbacks:
                callbacks.remove(self._first_steps)
        if self._sequence_wiring is not None:
            self._sequence_wiring.undo()
        self._sequence = self._sequence_wiring = None
        activate(None)
        error = self._processes.finish()  # the exit agreement comes first (processes.py)
        self._checkpoints.close(agree=not self._processes.failed)
        trainer = trainer_of(self.lightning_module)
        fitted = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if self.engine is not None:
            self._reshard()
            if fitted and not self._processes.failed:
                self.engine.restore_master_params()
            self.engine.teardown()
        if fitted:
            self._sharded.after_fit()
        if fitted and self._layer_sync and not self._sharded.shards_module_in_place:
            self.model = self._layer_sync.revert(
                require(self.model, "model")
            )  # give the user back their BatchNorm layers, as DDP
        require(self.cluster_environment, "cluster_environment").teardown()
        self.precision_plugin.teardown()
        require(self.accelerator, "accelerator").teardown()
        if error is not None:
            raise error

    # ------------------------------------------------------------------ checkpoints
    def _states(self, optimizers: bool = False) -> ShardedModel:
        """The sharding a checkpoint reads the module's and the optimizers' states through: this run's, or in
        ``validate``/``test``/``predict`` after a ``fit`` of the same module, the fit's. Lightning keeps a fit's
        optimizers on the trainer and writes their state into every later checkpoint, as under ``ddp``; that state
        is keyed by the fit's shards (masters, host rows), which an evaluation run's sharding does not hold.
        ``optimizers``: the caller writes their state, which is refused where the fit's sharding is gone."""
        trainer = trainer_of(self.lightning_module)
        if trainer is None or trainer.state.fn == TrainerFn.FITTING or not self.optimizers:
            return self._sharded
        if self._fitted is not None and self._fitted[1] is self.lightning_module:
            return self._fitted[0]
        if optimizers:
            run = f"`trainer.{trainer.state.fn.value}`" if trainer.state.fn is not None else "an evaluation"
            raise RuntimeError(
                f"trainer.save_checkpoint() during or after {run} cannot write the optimizer "
                "state of the earlier `fit`: this run evaluates another module, or loaded other weights into it "
                "(`ckpt_path=`). Save with `trainer.save_checkpoint(path, weights_only=True)`, or save before evaluating."
            )
        return self._sharded

    def _full_checkpoints(self) -> bool:
        return self._checkpoints.full

    def _held(self, state: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``state`` this rank's pipeline stages hold (another stage's tensors are meta here)."""
        return self._sharded.holding.held(state)

    def _reshard(self) -> None:
        """Close an accumulation window that keeps stage 3's units gathered (the engine's ``reshard``): a state
        dict, an evaluation loop and the end of training read the module as sharded."""
        engine = self._sharded.engine
        if engine is not None and engine.gathered_units is not None:
            engine.gathered_units.reshard()

    def full_state_dict(self) -> dict[str, Tensor]:
        """The module's unsharded ``state_dict`` on rank 0 (empty elsewhere), trainable parameters at the
        precision the optimizer updates them in. Collective."""
        module = require(self.lightning_module, "lightning_module")
        self._reshard()
        return self._checkpoints.full_model_state(module, self._states())

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = require(self.lightning_module, "lightning_module")
        self._reshard()
        return self._checkpoints.model_state(module, self._states())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        module = require(self.lightning_module, "lightning_module")
        return self._checkpoints.optimizer_state(optimizer, module, self._states(optimizers=True))

    @override
    @extended_during("saving a checkpoint")  # rank 0 may write alone while the others wait (faults/timeouts.py)
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint(storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        checkpoint["rng_states"] = collectives.all_gather_objects(collect_rng_state())
        self._resume.on_save(checkpoint, trainer_of(self.lightning_module))  # what a resume replays (resume/state.py)
        if self.auto_choice is not None:
            checkpoint[AUTO_CHECKPOINT_KEY] = self.auto_choice.record()  # a resumed fit reuses it
        self._checkpoints.save(
            checkpoint,
            path,
            self.lightning_module,
            self._states(),
            self.full_state_dict,
            self.precision_plugin.compute_dtype,
            self.is_global_zero,
            self.barrier,
        )

    def wait_for_checkpoint(self) -> None:
        """With ``async_save``: block until the save in flight (if any) is complete, and raise its failure on
        every rank. Collective. Fit already waits at each save and when training ends."""
        self._checkpoints.wait()

    @override
    def remove_checkpoint(self, filepath) -> None:
        self._checkpoints.remove(Path(filepath), self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        module = require(self.lightning_module, "lightning_module")
        trainer = trainer_of(module)
        # validate/test/predict from a checkpoint read the model alone, as Lightning's strategies do (a fit's
        # optimizers outlive it on the strategy).
        evaluating = trainer is not None and trainer.state.fn != TrainerFn.FITTING
        if evaluating:
            self._fitted = None  # the fit's optimizer state no longer belongs to the module's weights (`_states`)
        checkpoint = self._checkpoints.load(
            path,
            module,
            [] if evaluating else self.optimizers,
            self._sharded,
            strict=module.strict_loading,
            weights_only=weights_only is not False,
            average=None if evaluating else average_to_load(trainer),
        )
        states = checkpoint.get("rng_states")
        # Put back later in a fit, where the uninterrupted run was: [Note: when the RNG state is restored].
        self._resume.loaded(checkpoint, trainer, states[self.global_rank % len(states)] if states else None)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = require(self.lightning_module, "lightning_module")
        self._checkpoints.load_model_state(module, checkpoint["state_dict"], self._sharded, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        module = require(self.lightning_module, "lightning_module")
        clear_schedulers_for_swa(trainer_of(module))  # Lightning restores the schedulers next
        self._checkpoints.load_optimizer_states(self.optimizers, checkpoint, module, self._sharded)

    # ------------------------------------------------------------------ loops
    @override
    def on_train_start(self) -> None:
        if (trainer := trainer_of(self.lightning_module)) is not None:
            replicas = trainer.world_size // self.zero_config.sequence_parallel_size  # a group shares each sample
            check_batch_sizes(self._deepspeed, trainer, world_size=replicas)
        self._activate_fault_handling()
        if self._sequence is not None:
            self._sequence.check_from_here()  # the first batches' samples compared over each group
        self._resume.on_train_start(trainer)  # a resumed fit's RNG state, right before its first batch

    @override
    def on_train_end(self) -> None:
        self.wait_for_checkpoint()  # fit returns with its last checkpoint complete, or raises its failure everywhere

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """After a mid-epoch restore the train DataLoader continues its epoch where the checkpoint left it."""
        return self._resume.process_dataloader(dataloader, trainer_of(self.lightning_module))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Parameters unfrozen since the last step join the shards. Automatic optimization zeroes gradients at each
        window's first micro-batch; reduced shards live outside ``p.grad`` (stage 2), so drop them here too, or a
        window whose step was skipped would leak its gradients into the next one."""
        if (trainer := trainer_of(self.lightning_module)) is None:
            return
        self._resume.on_train_batch_start(trainer, batch_idx)
        if self.engine is not None:
            self.engine.follow_trainability()
            if trainer.lightning_module.automatic_optimization and batch_idx % trainer.accumulate_grad_batches == 0:
                self.engine.discard_all_gradients()

    @override
    def on_validation_start(self) -> None:
        self._activate_fault_handling()
        self._reshard()  # validation inside an accumulation window sees the sharded module
        self._sharded.sync_buffers()  # before evaluation, never per step: ranks may get different batch counts
        if self._sequence is not None:
            self._sequence.check_from_here()

    on_test_start = on_predict_start = on_validation_start

    def _activate_fault_handling(self) -> None:
        if (trainer := trainer_of(self.lightning_module)) is not None:
            self._processes.faults.activate(trainer.lightning_module, self._sharded.shards_module_in_place, trainer)

    # ------------------------------------------------------------------ steps
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Under sequence parallelism each rank keeps its part of the sequence (``sequence_parallel/batch.py``)."""
        if self._sequence is None:
            return super().batch_to_device(batch, device, dataloader_idx)
        self._sequence.check_same_batch(batch)  # before the move: a checksum read on the host
        return self._sequence.split(super().batch_to_device(batch, device, dataloader_idx))

    @contextlib.contextmanager
    def _across_the_sequence(self, forward: bool = True) -> Generator[None, None, None]:
        """Sequence parallelism active (a wired Hugging Face model's hooks and attention, the helpers) for a step's
        forward or backward, and in forward the interception that runs ``F.scaled_dot_product_attention`` over the
        group's whole sequence (a checkpointed block's recomputation enters it again in backward:
        ``activation_checkpointing/checkpointed_forward.py``). Outside the steps the models are plain."""
        if self._sequence is None:
            yield
            return
        activate(self._sequence)
        try:
            with AttentionInterception(self._sequence) if forward else contextlib.nullcontext():
                yield
        finally:
            activate(None)

    def _call_module(self, method: str, args: tuple, kwargs: dict) -> Any:
        """Stage 3's root is the LightningModule itself: route the step through its ``__call__`` so FSDP2's
        root hooks (unshard, lazy init, reshard) run around it."""
        module = require(self.lightning_module, "lightning_module")
        with self._across_the_sequence():
            if self._sharded.shards_module_in_place:
                out = self._forward_redirection(module, module, method, *args, **kwargs)
            else:
                out = getattr(module, method)(*args, **kwargs)
        sequence = self._sequence
        if sequence is not None and method in ("training_step", "validation_step"):
            if out is not None or sequence.exchanges:  # a step that returned nothing and attended nowhere skipped
                self._check_sequence_step(method, sequence)
        return out

    @staticmethod
    def _check_sequence_step(method: str, sequence: SequenceParallel) -> None:
        """A step that ran under sequence parallelism attended across the group and used global positions; the same
        code runs on every rank, so every rank stops together."""
        if not sequence.exchanges:
            raise ZeroConfigError(
                f"`sequence_parallel_size={sequence.size}`: no attention in the module's {method} went through "
                "F.scaled_dot_product_attention or a Hugging Face model's attention interface, so it attended over "
                "this rank's part of the sequence only. Compute attention with F.scaled_dot_product_attention on "
                "(batch, heads, positions, head_dim) tensors."
            )
        if not sequence.positions_given:
            raise ZeroConfigError(
                f"`sequence_parallel_size={sequence.size}`: the module's {method} never asked for its positions, so "
                f"every rank would use positions 0..{require(sequence.shard, 'shard').local_length - 1} for its part "
                "of the sequence. Build them with `lightning_zero.sequence_parallel.positions(T_local, device)` "
                "where the module calls `torch.arange(T)`. (Hugging Face causal LMs are handed theirs when called "
                "as `model(...)`; a wrapper that calls `model.forward(...)`, as PEFT's LoraModel does, skips that.)"
            )

    def _evaluation_step(self, split: str, method: str, context, args: tuple, kwargs: dict) -> Any:
        self._processes.faults.mark(split, args, kwargs)  # step marks: see engine/comm/flight.py
        with context():
            if self.pipeline is not None:
                return self.pipeline.evaluation_step(split, _batch(args, kwargs))
            return self._call_module(method, args, kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._processes.faults.mark("train", args, kwargs)
        self._sharded.sync_buffers()  # as DDP's `broadcast_buffers=True`, before every training step
        with self.precision_plugin.train_step_context():
            if self.pipeline is None:
                choice, module = self.auto_choice, require(self.lightning_module, "lightning_module")
                self._split_step = None  # a step whose backward Lightning skipped (SWA's BatchNorm epoch) left it
                split = module.automatic_optimization and self._sequence is None  # a resumed choice may not fit
                if choice is not None and choice.splits > 1 and split:
                    # [Note: a batch's parts in Lightning's order]
                    self._split_step = SplitStep(self, choice, args, kwargs)
                    return self._split_step.start()
                return self._call_module("training_step", args, kwargs)
            # The schedule runs forward, loss and backward here; `backward` then hands the gradients on.
            scale = (
                self.precision_plugin.loss_scale
                / require(self.lightning_module, "lightning_module").trainer.accumulate_grad_batches
            )
            return self.pipeline.training_step(_batch(args, kwargs), scale, self.engine)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("val", "validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test", "test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise ZeroConfigError(
                "`predict` is not available with `pipeline_stages > 1` (only the last stage sees the "
                "outputs): load the checkpoint into a run without pipelining to predict."
            )
        return self._evaluation_step(
            "predict", "predict_step", self.precision_plugin.predict_step_context, args, kwargs
        )

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: no gradient communication."""
        engine = self.engine
        quiet = engine is not None and not self.zero_config.reduce_every_microbatch
        self._accumulating = True  # even where its gradients are reduced, this backward's are not the step's
        try:
            with engine.no_sync() if engine is not None and quiet else contextlib.nullcontext():
                yield
        finally:
            self._accumulating = False

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """As Lightning's, but the reduced gradient shards land before ``on_after_backward`` runs, so hooks
        (and memory probes) see the state a step will use. A batch ``stage="auto"`` splits runs its further parts
        here ([Note: a batch's parts in Lightning's order])."""
        split, self._split_step = self._split_step, None
        if split is not None:  # `closure_loss` is the first part's, as Lightning divided it: the part divides once
            return split.finish(lambda loss: self._backward_one(loss, optimizer, *args, **kwargs))
        return self._backward_one(closure_loss, optimizer, *args, **kwargs)

    def _backward_one(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module = require(self.lightning_module, "lightning_module")
        self.partial_gradients = self._accumulating
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self.pipeline is not None:
            self.pipeline.restore_gradients()  # the schedule ran backward inside `training_step`
        else:
            follows = self._step_follows_backward(module) if self.engine is not None and optimizer is not None else None
            if self.engine is not None and optimizer is not None and follows is not None:
                self.engine.step_during_backward(unwrap(optimizer), clipped=follows == "clipped")
            with self._across_the_sequence(forward=False):  # recomputations of a Hugging Face model's attention
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if self.engine is not None:
            self.engine.post_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _step_follows_backward(self, module: pl.LightningModule) -> str | None:
        """How the optimizer step after this backward uses its gradients as they land, averaged: ``"as is"``
        (automatic optimization without clipping or a loss scaler), ``"clipped"`` (the same with Lightning's clipping
        by the global norm), or None (anything else may change them): the offloaded host step may start during
        backward (see [Note: the host step during backward] in ``engine/offload/schedule.py``; clipped, speculatively:
        [Note: speculative clipping] in ``engine/offload/speculation.py``)."""
        trainer = trainer_of(module)
        if not (
            self.zero_config.optimizer_on_host
            and not self._accumulating
            and trainer is not None
            and module.automatic_optimization
            and not is_overridden("configure_gradient_clipping", module, pl.LightningModule)
            and getattr(self.precision_plugin, "scaler", None) is None
            and not may_change_gradients(module, getattr(trainer, "callbacks", []))
        ):
            return None
        if not trainer.gradient_clip_val:
            return "as is"
        algorithm = trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM  # Lightning's default when unset
        return "clipped" if algorithm == GradClipAlgorithmType.NORM else None

    def gather_gradients(self, optimizer: Optimizer | None = None) -> dict[str, Tensor]:
        """Full (unsharded) gradients by parameter name, on every rank. Collective; for a step that needs the whole
        gradient where ``p.grad`` holds shards (sharpness-aware minimization at stages 1-2), debugging and tests:
        call it where gradients are final, e.g. after ``manual_backward`` or in ``on_before_optimizer_step``."""
        optimizers = [unwrap(o) for o in ([optimizer] if optimizer is not None else self.optimizers)]
        return self._sharded.gather_gradients(optimizers, self.precision_plugin.finalize_gradients)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, kwargs in REGISTERED_STRATEGIES.items():
            strategy_registry.register(name, cls, description=f"ZeroStrategy({kwargs})", **kwargs)


def trainer_of(module: pl.LightningModule | None) -> pl.Trainer | None:
    return module.trainer if module is not None and module._trainer is not None else None


def _batch(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs["batch"]
