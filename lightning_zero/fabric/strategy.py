"""ZeroStrategy for Lightning Fabric: ``L.Fabric(strategy="zero3")`` over the same engine as the ``Trainer`` strategy.

A Fabric loop calls the module, ``fabric.backward``, ``fabric.clip_gradients`` and ``optimizer.step()`` itself, so this
strategy is the thin shell that maps those calls onto the collaborators the ``Trainer`` strategy holds too
(``strategy/``): :class:`~lightning_zero.strategy.processes.DistributedProcesses` (the process group and the watchdog),
``sharding.shard_model`` (the engine), :class:`~lightning_zero.precision.ZeroPrecision` (finalizing, clipping, loss
scaling, the step) and :class:`~lightning_zero.strategy.checkpoints.ShardedCheckpoints` (the one checkpoint format,
in the layout of ``checkpoint/layout.py``, so a ``Trainer`` resumes from what a Fabric loop saved and the other way
round).

What differs from the ``Trainer``: the loop owns clipping, so with ``offload_optimizer`` the offloaded step runs after
backward (the serial path), never during it; the loop owns the data, so ``pipeline_stages`` and
``sequence_parallel_size``, which take over the step's schedule and the batch, are ``Trainer``-only.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import _Stateful
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override

from lightning_zero.checkpoint import delayed_update, error_feedback, selective_updates
from lightning_zero.checkpoint.io import AVERAGE_LOADED, load_optimizer_state
from lightning_zero.checkpoint.layout import FABRIC_KEYS, LIGHTNING_ENTRIES, FabricKeys, as_full_file
from lightning_zero.checkpoint.state_dicts import CURRENT_MODEL_STATE
from lightning_zero.checkpoint.verify import META_FILE, check_complete, read_checkpoint_dict
from lightning_zero.config.choices import ZeroConfigError, closest
from lightning_zero.config.zero_config import AUTO, REGISTERED_STRATEGIES, ZeroConfig
from lightning_zero.deepspeed_compat.config import CONFIG_DEFAULTS, DeepSpeedSettings, strategy_settings
from lightning_zero.deepspeed_compat.trainer import precision_plugin_for
from lightning_zero.engine.comm import collectives
from lightning_zero.faults.timeouts import extended_during
from lightning_zero.precision.zero_precision import ZeroPrecision, as_zero_precision
from lightning_zero.resume.rng import collect_rng_state, restore_rng_state
from lightning_zero.strategy import processes
from lightning_zero.strategy.core import StrategyCore
from lightning_zero.strategy.processes import require
from lightning_zero.strategy.sharding import NOT_SHARDED, construction_device, shard_model
from lightning_zero.strategy.zero_strategy import ZeroStrategy as TrainerZeroStrategy

#: Entries a checkpoint holds for the strategy itself, never handed back to the loop by ``fabric.load``.
_INTERNAL_ENTRIES = (
    *LIGHTNING_ENTRIES,
    FABRIC_KEYS,
    "rng_states",
    "pytorch-lightning_version",
    "hf_export",
    "optimizer_param_groups",
    AVERAGE_LOADED,
    CURRENT_MODEL_STATE,
    delayed_update.KEY,
    selective_updates.KEY,
    error_feedback.KEY,
    error_feedback.TABLE_KEY,
    error_feedback.SIGNATURE_KEY,
    ZeroPrecision.__qualname__,  # the loss scale, where Lightning keeps a precision plugin's state
)
#: What a DeepSpeed config asks of the ``Trainer`` (the ``DeepSpeedSettings`` field, its key there), which a Fabric
#: loop does itself.
_LOOP_SETTINGS = {
    "gradient_clip_val": ("gradient_clipping", "call `fabric.clip_gradients(model, optimizer, max_norm=...)`"),
    "accumulate_grad_batches": (
        "gradient_accumulation_steps",
        "accumulate in the loop, under `fabric.no_backward_sync(model)`",
    ),
    "micro_batch_size": ("train_micro_batch_size_per_gpu", "set the DataLoader's `batch_size`"),
    "train_batch_size": ("train_batch_size", "set the DataLoader's `batch_size`"),
    "optimizer": ("optimizer", "build the optimizer in the loop and pass it to `fabric.setup`"),
    "scheduler": ("scheduler", "build the scheduler in the loop"),
}


class ZeroStrategy(StrategyCore, ParallelStrategy, _Sharded):
    """ZeRO data parallelism for a Lightning Fabric loop: stage 1 shards optimizer state, stage 2 also gradients, stage
    3 also parameters (over FSDP2), on the same engine as the ``Trainer`` strategy.

    It takes the ``Trainer`` strategy's settings, by the same names (``offload_optimizer=``, ``config=`` for a
    DeepSpeed JSON, ...): see :class:`lightning_zero.ZeroStrategy`. Every setting is validated here, on every rank,
    before any process group exists. ``L.Fabric(strategy="zero3")`` (and the other registered names) builds one.
    """

    def __init__(
        self,
        stage: int = 2,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **settings: Any,
    ) -> None:
        config = settings.pop("config", None)
        for name in settings:
            if name not in CONFIG_DEFAULTS:
                raise ZeroConfigError(
                    f"lightning_zero.fabric.ZeroStrategy got an unknown setting `{name}`.{closest(name, CONFIG_DEFAULTS)} "
                    "It takes the settings of lightning_zero.ZeroStrategy (docs/configuration.md)."
                )
        zero_config, deepspeed = strategy_settings({"stage": stage, **settings}, config)
        _refuse_trainer_only(zero_config, deepspeed)
        self._hold(zero_config, deepspeed)  # the settings and the collaborators (strategy/core.py)
        self._num_nodes = 1
        self._module: nn.Module | None = None
        self._optimizers: list[Optimizer] = []
        #: ``id(parameter)`` -> the parameter (weakly) and its name, as the module held them before sharding (an
        #: optimizer built from those).
        self._names_before_sharding: dict[int, tuple[weakref.ref[Tensor], str]] = {}
        #: A backward has run since the last step: the accumulation window is open.
        self._window_open = False
        #: Optimizer steps taken (the step a fault's diagnosis names).
        self._steps = 0
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._backward_sync_control = _ZeroBackwardSyncControl(self)

    # ------------------------------------------------------------------ properties
    @property
    @override
    def root_device(self) -> torch.device:
        return require(self.parallel_devices, "parallel_devices")[self.local_rank]

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
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    @override
    def precision(self) -> ZeroPrecision:
        plugin = self._precision
        if not isinstance(plugin, ZeroPrecision):  # None until Fabric chooses: the setter converts every other
            plugin = self._precision = ZeroPrecision()
        return plugin

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        if precision is not None and precision is self._precision:
            return  # a Fabric handing back the plugin this strategy chose
        self._precision = as_zero_precision(precision_plugin_for(getattr(self, "_deepspeed", None), precision))

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        environment = require(self.cluster_environment, "cluster_environment")
        world_size = processes.cluster_world_size(environment, self.num_nodes, self.num_processes)
        self.zero_config.group_sizes(world_size, self.num_processes)  # shard_size / hpZ fit the cluster
        if self.zero_config.start_method == "popen":  # `fabric run`, torchrun, or the script started once per device
            self._launcher = _SubprocessScriptLauncher(environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _ReportingLauncher(self, start_method=self.zero_config.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        environment = require(self.cluster_environment, "cluster_environment")
        environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        environment.set_world_size(self.num_nodes * self.num_processes)
        # Both functions carry the rank as an attribute Lightning sets at run time, undeclared.
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self._processes.start(environment, self.root_device, self.global_rank, self.world_size, self.num_processes)
        # A Fabric loop has no end nor failure the strategy hears of: finish at the process's exit, and hear of an
        # error that ends a script (`fabric run`, torchrun) through the interpreter's hook for it.
        # Both hold the strategy weakly: a strategy (its module, its optimizer state) goes when the loop drops it.
        global _LAUNCHED
        _LAUNCHED = weakref.ref(self)
        atexit.register(_finish_at_exit, _LAUNCHED)
        if sys.excepthook is not _excepthook:
            global _previous_excepthook
            _previous_excepthook, sys.excepthook = sys.excepthook, _excepthook

    def on_exception(self, exception: BaseException) -> None:
        """An error ends this rank's loop: name the first failure on every rank (the watchdog's store), so the ranks
        it brings down say which rank failed first and why, rather than only that a peer is gone."""
        self._processes.on_exception(exception)

    def finish_at_exit(self) -> None:
        """The process exits without ``teardown``: an ``async_save`` in flight completes (every rank's loop ended,
        so every rank is here), unless a rank failed; then the watchdog stops."""
        if self._module is not None and not self._processes.failed:
            try:
                self._checkpoints.close(agree=True)
            except Exception as error:  # noqa: BLE001 - at exit the message is all that can still reach the user
                print(f"[lightning_zero] the last checkpoint was not completed: {error}", file=sys.stderr)
        self._processes.faults.stop()

    @override
    def barrier(self, name: str | None = None) -> None:
        processes.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return processes.broadcast(obj, src)

    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """``fabric.all_reduce``: mean (the default), sum, max or min over the ranks."""
        return processes.reduce(tensor, group, reduce_op, self.world_size)

    # ------------------------------------------------------------------ module and optimizers
    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``fabric.init_module()``: at stage 3 with ``empty_init=True`` the module is built on the meta device and
        materialised one unit at a time as it is sharded, so no rank ever holds it whole (``engine/stage3/materialize.py``:
        the same values as an eager build for modules that initialise in ``reset_parameters``)."""
        stack = contextlib.ExitStack()
        if empty_init and self.zero_config.shards_parameters:
            stack.enter_context(construction_device(self.zero_config))
        else:
            stack.enter_context(self.root_device)
            stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> contextlib.AbstractContextManager:
        return self.module_init_context(empty_init=True)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not self.zero_config.shards_parameters:  # stage 3 places each rank's shards as it shards
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place (activation checkpointing, the engine, pretrained weights), as the ``Trainer``
        strategy does in ``setup``. One module per strategy."""
        if self._module is not None:
            raise ZeroConfigError(
                f"lightning_zero.fabric.ZeroStrategy shards one module per Fabric; {_name(self._module)} is set up "
                f"already. Put {_name(module)} inside it, or use another Fabric for it."
            )
        # Weakly: once sharding dropped them their ids may be reused by any new tensor.
        self._names_before_sharding = {id(p): (weakref.ref(p), name) for name, p in module.named_parameters()}
        precision = self.precision
        self._sharded = shard_model(
            module,
            self.zero_config,
            policy=precision.policy(),
            checkpoint_policy=self.checkpoint_policy,
            fitting=True,
            rank=self.global_rank,
            world_size=self.world_size,
            node_size=self.num_processes,
            device=self.root_device,
            move_to_device=lambda: self.module_to_device(module),
        )
        self._module = module
        precision.attach(self.engine, self.root_device)
        self._checkpoints.open([], self.is_global_zero)
        self._processes.faults.activate(module, self._sharded.shards_module_in_place)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Hand ``optimizer`` to the engine, which steps this rank's shards. An optimizer built before the module was
        set up (``fabric.setup(model, optimizer)``) is given the sharded module's parameters by name."""
        engine = self.engine
        if engine is None:
            raise ZeroConfigError(
                "lightning_zero.fabric.ZeroStrategy: set up the module before its optimizer: "
                "`model = fabric.setup_module(model)`, then `optimizer = fabric.setup_optimizers(optimizer)`, "
                "or both at once with `model, optimizer = fabric.setup(model, optimizer)`."
            )
        self._give_sharded_parameters(optimizer)
        config = self.zero_config
        engine.wrap_optimizer(optimizer, config.elementwise_optimizers, config.matrix_optimizers)
        self._hear_zero_grad(optimizer)
        if not config.optimizer_on_host:
            _optimizers_to_device([optimizer], self.root_device)
        self._optimizers.append(optimizer)
        return optimizer

    def _hear_zero_grad(self, optimizer: Optimizer) -> None:
        """``optimizer.zero_grad()`` drops what the engine holds of the gradients (its own ``zero_grad``, which
        ``engine/optimizers.py`` puts on the instance) and closes the accumulation window, so the next backward starts
        a new one, also where the loop skips a step (a non-finite norm). Fabric's wrapper looks ``zero_grad`` up on
        the optimizer's class, never the instance: the class gets a subclass whose ``zero_grad`` calls the instance's.
        """
        engine_zero_grad = optimizer.zero_grad
        strategy = weakref.ref(self)

        def zero_grad(set_to_none: bool = True) -> None:
            alive = strategy()
            if alive is not None:  # a 16-mixed overflow the loop skipped the step for still backs the scale off
                alive.precision.step_skipped(optimizer)
            engine_zero_grad(set_to_none)
            if alive is not None:
                alive._window_open = False

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        base = type(optimizer)
        if not getattr(base, "_lightning_zero_hears_zero_grad", False):
            optimizer.__class__ = type(
                base.__name__,
                (base,),
                {
                    "zero_grad": _instance_zero_grad,
                    "_lightning_zero_hears_zero_grad": True,
                    "__module__": base.__module__,
                },
            )

    def _give_sharded_parameters(self, optimizer: Optimizer) -> None:
        module = require(self._module, "module")
        current = dict(module.named_parameters())
        live = {id(p) for p in current.values()}
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if id(p) in live:
                    params.append(p)
                    continue
                known = self._names_before_sharding.get(id(p))
                name = known[1] if known is not None and known[0]() is p else None
                if name is None or name not in current:
                    raise ZeroConfigError(
                        f"{type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} that is not one of "
                        f"{_name(module)}'s: build the optimizer from the module's parameters."
                    )
                if optimizer.state.get(p):
                    raise ZeroConfigError(
                        f"{type(optimizer).__name__} has state for `{name}` already (some optimizers, such as Adagrad, "
                        "make it when built): build it from the set-up module's parameters "
                        "(`model = fabric.setup_module(model)`, then the optimizer), and load saved state with "
                        "`fabric.load`."
                    )
                params.append(current[name])
            group["params"] = params

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    # ------------------------------------------------------------------ steps
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """The loss (scaled under ``16-mixed``) backward; the gradient reductions still in flight land before it
        returns. A window's first backward first takes in parameters made trainable since the last step."""
        engine = self.engine
        if engine is not None and not self._window_open:
            self._processes.faults.mark("train", (None, self._steps), {})  # the step a diagnosis names
            engine.follow_trainability()
            engine.discard_all_gradients()
        self._window_open = True
        self.precision.scale_loss(tensor).backward(*args, **kwargs)
        if engine is not None:
            engine.post_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step this rank's shards (skipped on every rank where ``16-mixed`` found an inf/NaN). Collective."""
        self._window_open = False
        self._steps += 1
        result = self.precision.step_shards(optimizer, **kwargs)
        self._sharded.sync_buffers()  # rank 0's buffers (BatchNorm statistics) on every rank, as DDP's forward does
        return result

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the global 2-norm over every rank's gradient shards; returns that norm before clipping (inf where
        ``16-mixed`` found an inf/NaN: the step is skipped on every rank). Collective."""
        if float(norm_type) != 2.0:
            raise ZeroConfigError(
                f"fabric.clip_gradients(norm_type={norm_type!r}): lightning_zero.fabric.ZeroStrategy clips by the "
                "global 2-norm only (norm_type=2)."
            )
        total = self.precision.clip_by_global_norm(optimizer, float(max_norm))
        if total is None:
            return torch.tensor(float("inf"))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order 2.0 for gradients is non-finite ({float(total)}), so it cannot be clipped. "
                "To disable this error, call `fabric.clip_gradients(..., error_if_nonfinite=False)`."
            )
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.clip_grad_by_value(optimizer, float(clip_val))

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> dict[str, Tensor]:
        """The set-up module's unsharded ``state_dict`` on rank 0 (empty elsewhere), trainable parameters at the
        precision the optimizer updates them in. Collective."""
        self._reshard()
        module = require(self._module, "a module set up with `fabric.setup`")
        return self._checkpoints.full_model_state(module, self._sharded)

    def _reshard(self) -> None:
        engine = self._sharded.engine
        if engine is not None and engine.gathered_units is not None:
            engine.gathered_units.reshard()

    def _entries(self, state: Mapping[str, Any]) -> tuple[str, nn.Module, FabricKeys]:
        """The set-up module's key in a loop's dictionary, and the :class:`FabricKeys` of its objects."""
        modules = [key for key, obj in state.items() if isinstance(obj, nn.Module)]
        module = self._module
        if module is None or len(modules) != 1 or state[modules[0]] is not module:
            found = ", ".join(repr(k) for k in modules) or "none"
            raise ZeroConfigError(
                "lightning_zero.fabric.ZeroStrategy saves and loads a dictionary holding the module it set up (once, "
                f"e.g. `{{'model': model, 'optimizer': optimizer}}`); its modules: {found}."
            )
        optimizers = [key for key, obj in state.items() if isinstance(obj, Optimizer)]
        for key in optimizers:
            if state[key] not in self._optimizers:
                raise ZeroConfigError(f"`{key}`: an optimizer Fabric did not set up with this strategy.")
        schedulers = [key for key, obj in state.items() if isinstance(obj, LRScheduler)]
        if clashes := [name for name in state if name in _INTERNAL_ENTRIES]:
            raise ZeroConfigError(
                f"The checkpoint entries {clashes} are reserved by the checkpoint format; rename them."
            )
        return modules[0], module, FabricKeys(modules[0], tuple(optimizers), tuple(schedulers))

    @override
    @extended_during("saving a checkpoint")  # rank 0 may write alone while the others wait (faults/timeouts.py)
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save``: the format the ``Trainer`` strategy writes (``checkpoint/layout.py``), sharded or full
        (``state_dict_type``), atomically. ``filter``: per entry, which of its items to keep (the module's by parameter
        name, as LitGPT saves LoRA weights alone); not for optimizers, whose state is keyed by the shards."""
        if storage_options is not None:
            raise TypeError("lightning_zero.fabric.ZeroStrategy.save_checkpoint(storage_options=...) is not supported.")
        filter = filter or {}
        target = Path(self.broadcast(str(path)))
        key, module, keys = self._entries(state)
        if refused := [k for k in filter if k in keys.optimizers]:
            raise ZeroConfigError(f"fabric.save(filter=...) for the optimizer entries {refused} is not supported.")
        self._reshard()
        sharded = self._sharded
        checkpoint: dict[str, Any] = {"pytorch-lightning_version": lightning.__version__, FABRIC_KEYS: keys.as_entry()}
        checkpoint["state_dict"] = _kept(self._checkpoints.model_state(module, sharded), filter.get(key))
        checkpoint["optimizer_states"] = [
            self._checkpoints.optimizer_state(state[k], module, sharded) for k in keys.optimizers
        ]
        checkpoint["lr_schedulers"] = [state[k].state_dict() for k in keys.schedulers]
        for name, obj in state.items():
            if name not in (key, *keys.optimizers, *keys.schedulers):
                value = obj.state_dict() if isinstance(obj, _Stateful) else obj
                checkpoint[name] = _kept(value, filter.get(name)) if isinstance(value, dict) else value
        if precision_state := self.precision.state_dict():  # the loss scale, where Lightning keeps it
            checkpoint[type(self.precision).__qualname__] = precision_state
        checkpoint["rng_states"] = collectives.all_gather_objects(collect_rng_state())
        self._checkpoints.save(
            checkpoint,
            target,
            module,
            sharded,
            lambda: self._checkpoints.full_model_state(module, sharded),
            self.precision.compute_dtype,
            self.is_global_zero,
            self.barrier,
        )

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load``: a checkpoint either front end saved (sharded at any world size and stage, or full) into the
        loop's objects, in place; returns the entries it did not restore. ``fabric.load_raw`` (a module or an
        optimizer alone): a plain state dict file, or a checkpoint's module or first optimizer. Nothing is unpickled
        but tensors and plain values (``weights_only=False`` is refused)."""
        target = Path(self.broadcast(str(path)))
        safe = weights_only is not False
        if state is None or (isinstance(state, dict) and not state):
            if target.is_dir():
                raise ZeroConfigError(
                    f"fabric.load({str(path)!r}) without objects to load into: a sharded checkpoint is read into the "
                    "set-up module and optimizers (`fabric.load(path, {'model': model, 'optimizer': optimizer})`); "
                    "`lightning-zero consolidate` writes it as one file."
                )
            checkpoint = self._checkpoints.load(target, nn.Module(), [], NOT_SHARDED, strict, safe, None)
            return as_full_file(checkpoint)  # as the loop saved it
        module = require(self._module, "a module set up with `fabric.setup`")
        self._reshard()
        if isinstance(state, nn.Module):
            if state is not module:
                raise ZeroConfigError("fabric.load_raw(path, module): the module must be the one Fabric set up.")
            self._load_module_alone(target, strict, safe)
            return {}
        if isinstance(state, Optimizer):
            if target.is_dir():
                raise ZeroConfigError(
                    "fabric.load_raw(path, optimizer) reads a file; load a sharded checkpoint with the module: "
                    "`fabric.load(path, {'model': model, 'optimizer': optimizer})`."
                )
            checkpoint = self._checkpoints.load(target, module, [], self._sharded, strict, safe, None)
            optimizer_state = checkpoint["optimizer_states"][0] if "optimizer_states" in checkpoint else checkpoint
            load_optimizer_state(state, optimizer_state, module, self._sharded.engine, holding=self._sharded.holding)
            return {}
        return self._load_into(target, state, strict, safe)

    def _load_module_alone(self, path: Path, strict: bool, safe: bool) -> None:
        module = require(self._module, "module")
        checkpoint = self._checkpoints.load(path, module, [], self._sharded, strict, safe, None)
        if path.is_file():  # a plain state dict, or a checkpoint's module entry
            state_dict = checkpoint["state_dict"] if _is_checkpoint(checkpoint) else checkpoint
            self._checkpoints.load_model_state(module, state_dict, self._sharded, strict)

    def _load_into(self, path: Path, state: dict[str, Any], strict: bool, safe: bool) -> dict[str, Any]:
        """The loop's objects from a checkpoint: by the keys it was saved under where a Fabric loop saved it, by
        position in a ``Trainer``'s. What the loop asks for and the checkpoint lacks is found before anything loads."""
        key, module, keys = self._entries(state)
        sharded = self._sharded
        if path.is_dir():
            check_complete(path)
            preview = read_checkpoint_dict(path / META_FILE)  # the entries but the tensors
            saved_optimizers = len(preview.get("optimizer_param_groups", []))
        else:
            preview = self._checkpoints.load(path, module, [], sharded, strict, safe, None)  # reads, loads nothing
            saved_optimizers = len(preview.get("optimizer_states", []))
        if path.is_file() and not _is_checkpoint(preview):  # a directory is one
            raise ZeroConfigError(
                f"{path} holds a plain state dict, not a checkpoint: load it with `fabric.load_raw(path, model)`."
            )
        saved_schedulers = len(preview.get("lr_schedulers", []))
        if FABRIC_KEYS in preview:
            saved = FabricKeys.from_entry(preview[FABRIC_KEYS])
        else:  # a Trainer's: its optimizers and schedulers in the loop's order
            saved = FabricKeys(key, keys.optimizers[:saved_optimizers], keys.schedulers[:saved_schedulers])
        order = [k for k in saved.optimizers if k in keys.optimizers]
        if order != list(saved.optimizers[: len(order)]):
            raise ZeroConfigError(
                f"fabric.load: {path} holds the optimizers {list(saved.optimizers)} in this order; load all of them, "
                f"or the first ones, under those keys (asked for: {list(keys.optimizers)})."
            )
        missing = [k for k in (*keys.optimizers, *keys.schedulers) if k not in (*saved.optimizers, *saved.schedulers)]
        missing += [k for k in state if k not in (key, *keys.optimizers, *keys.schedulers) and k not in preview]
        if strict and missing:
            raise KeyError(
                f"The requested state contains the entries {missing} that the checkpoint at {path} does not hold. "
                "To load what it holds, call `fabric.load(..., strict=False)`."
            )
        optimizers = [state[k] for k in order]
        if path.is_dir():  # loaded in place
            checkpoint = self._checkpoints.load(path, module, optimizers, sharded, strict, safe, None)
        else:  # a full file's states are loaded from here
            checkpoint = preview
            self._checkpoints.load_model_state(module, checkpoint["state_dict"], sharded, strict)
            if optimizers:
                self._checkpoints.load_optimizer_states(optimizers, checkpoint, module, sharded)
        for name in keys.schedulers:
            if name in saved.schedulers:
                state[name].load_state_dict(checkpoint["lr_schedulers"][saved.schedulers.index(name)])
        if optimizers:  # resuming training: the loss scale and this rank's draws go on as saved
            if (precision_state := checkpoint.get(type(self.precision).__qualname__)) is not None:
                self.precision.load_state_dict(precision_state)
            if rng := checkpoint.get("rng_states"):
                restore_rng_state(rng[self.global_rank % len(rng)])
        remainder = {k: v for k, v in checkpoint.items() if k not in _INTERNAL_ENTRIES}
        for name, obj in state.items():
            if name in (key, *keys.optimizers, *keys.schedulers) or name not in remainder:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(remainder.pop(name))
            else:
                state[name] = remainder.pop(name)
        return remainder

    # ------------------------------------------------------------------ end
    @override
    def teardown(self) -> None:
        """Optional in a Fabric loop (Fabric never calls it): the exit agreement with the other ranks, the module given
        back at full precision, the engine's hooks removed."""
        error = self._processes.finish()
        self._checkpoints.close(agree=not self._processes.failed)
        engine = self.engine
        if engine is not None:
            self._reshard()
            if not self._processes.failed:
                engine.restore_master_params()
            engine.teardown()
        self._sharded.after_fit()
        self._sharded, self._module, self._optimizers = NOT_SHARDED, None, []
        self._names_before_sharding, self._window_open, self._steps = {}, False, 0
        self.precision.attach(None)
        require(self.cluster_environment, "cluster_environment").teardown()
        super().teardown()
        if error is not None:
            raise error

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, kwargs in REGISTERED_STRATEGIES.items():
            if kwargs.get("stage") == AUTO:
                continue  # the planner needs the Trainer (see `_refuse_trainer_only`)
            strategy_registry.register(name, cls, description=f"lightning_zero.fabric.ZeroStrategy({kwargs})", **kwargs)


#: The strategy this process set up last (``setup_environment``), weakly, for the error that ends its loop.
_LAUNCHED: weakref.ref[ZeroStrategy] | None = None
#: ``sys.excepthook`` before :func:`_excepthook` was chained in front of it.
_previous_excepthook: Callable[..., Any] | None = None


def _instance_zero_grad(optimizer: Any, set_to_none: bool = True) -> None:
    """``zero_grad`` as Fabric's optimizer wrapper calls it: the wrapped optimizer's own (see ``_hear_zero_grad``)."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    # Through Fabric's wrapper: the instance's. Called on the optimizer itself it is the class's own `zero_grad` (the
    # engine's instance `zero_grad` calls `type(optimizer).zero_grad`; a later run's engine wraps this one again).
    heard = inner.__dict__.get("zero_grad") if inner is not optimizer else None
    if heard is not None:
        heard(set_to_none)
    else:
        super(type(inner), inner).zero_grad(set_to_none)


def _report(error: BaseException) -> None:
    strategy = _LAUNCHED() if _LAUNCHED is not None else None
    if strategy is not None:
        with contextlib.suppress(Exception):  # the error itself must reach the user whatever the store does
            strategy.on_exception(error)


def _excepthook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
    """An error ends a script (``fabric run``, torchrun): report it, then print it as before."""
    _report(value)
    (_previous_excepthook or sys.__excepthook__)(kind, value, traceback)


def _finish_at_exit(strategy: weakref.ref[ZeroStrategy]) -> None:
    if (alive := strategy()) is not None:
        alive.finish_at_exit()


def _reporting(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a function Fabric launched in a spawned or forked process, reporting the error that ends it (the processes
    torch starts catch it before the interpreter's hook would see it)."""
    try:
        return function(*args, **kwargs)
    except BaseException as error:
        if not (isinstance(error, SystemExit) and error.code in (0, None)):  # a clean exit is no failure
            _report(error)
        raise


class _ReportingLauncher(_MultiProcessingLauncher):
    """Fabric's launcher for ``start_method="spawn"`` / ``"fork"``, reporting the error that ends a rank's function."""

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return super().launch(functools.partial(_reporting, function), *args, **kwargs)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the micro-batches of an accumulation window before its last reduce no
    gradients (the engine's ``no_sync``, as the ``Trainer``'s ``accumulate_grad_batches``)."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        engine = self._strategy.engine
        if not enabled or engine is None or self._strategy.zero_config.reduce_every_microbatch:
            return contextlib.nullcontext()
        return engine.no_sync()


def _refuse_trainer_only(config: ZeroConfig, deepspeed: DeepSpeedSettings | None) -> None:
    """Settings a Fabric loop cannot take: they take over the step's schedule, the batch, or a part of the loop."""
    if not config.chosen:
        raise ZeroConfigError(
            "`stage='auto'` needs the Trainer: the planner traces the module's `training_step` on the train "
            "DataLoader's first batch and splits each batch into micro-batches, and a Fabric loop owns both. Name a "
            "stage (1, 2 or 3); `lightning-zero plan` predicts each one's memory and picks the fastest that fits."
        )
    if config.pipeline_stages > 1:
        raise ZeroConfigError(
            f"`pipeline_stages={config.pipeline_stages}` needs the Trainer: the pipeline schedule runs forward, loss "
            "and backward together in `training_step`, where a Fabric loop calls them itself. Use "
            "lightning_zero.ZeroStrategy with lightning.Trainer."
        )
    if config.sequence_parallel_size > 1:
        raise ZeroConfigError(
            f"`sequence_parallel_size={config.sequence_parallel_size}` needs the Trainer, which cuts each batch "
            "before the step. Use lightning_zero.ZeroStrategy with lightning.Trainer."
        )
    if deepspeed is None:
        return
    for field, (key, instead) in _LOOP_SETTINGS.items():
        value = getattr(deepspeed, field)
        if value is not None and value != "auto":
            raise ZeroConfigError(
                f"DeepSpeed config: `{key}` is applied by the Trainer; in a Fabric loop {instead}, and remove it "
                "from the config."
            )


def _name(module: nn.Module) -> str:
    """The module's class as the user wrote it (stage 3 converts it in place to an ``FSDP``-prefixed subclass)."""
    return type(module).__name__.removeprefix("FSDP") if isinstance(module, FSDPModule) else type(module).__name__


def _kept(value: dict[str, Any], keep: Callable[[str, Any], bool] | None) -> dict[str, Any]:
    return value if keep is None else {k: v for k, v in value.items() if keep(k, v)}


def _is_checkpoint(checkpoint: Mapping[str, Any]) -> bool:
    """A checkpoint either front end wrote, rather than a plain state dict."""
    return "state_dict" in checkpoint and ("pytorch-lightning_version" in checkpoint or FABRIC_KEYS in checkpoint)


def _constructor_signature() -> inspect.Signature:
    """The constructor's signature as ``inspect.signature`` and ``help()`` show it: ``stage``, the ``Trainer``
    strategy's settings with their types and defaults, then Fabric's own. The settings arrive as ``**settings`` and
    :class:`ZeroConfig` checks them, so the two strategies' lists cannot drift apart."""
    trainer = inspect.signature(TrainerZeroStrategy.__init__).parameters
    own = inspect.signature(ZeroStrategy.__init__).parameters
    shared = [p for name, p in trainer.items() if name != "stage" and (name in CONFIG_DEFAULTS or name == "config")]
    fabric = [p for p in own.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return inspect.Signature([own["self"], trainer["stage"], *shared, *fabric])


ZeroStrategy.__init__.__signature__ = _constructor_signature()  # type: ignore[attr-defined]
