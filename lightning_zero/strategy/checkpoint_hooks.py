"""The checkpoint half of ZeroStrategy: Lightning's save and load hooks over the ``checkpoint/`` package.

A save adds every rank's RNG state, the resume position and a Hugging Face description to Lightning's
dictionary, then one writer runs (full, sharded, or in the background with ``async_save``), with the 16-bit
export beside it when asked. States and loads cover the tensors this rank holds (``ShardedModel.holding``)
through the engine's shard records.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint import delayed_update, error_feedback, hf_export, io, state_dicts, write
from lightning_zero.checkpoint.async_save import AsyncSaver, checkpoint_group
from lightning_zero.checkpoint.error_feedback import warn_residuals_not_kept
from lightning_zero.checkpoint.files import clean_directory, remove
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.engine.comm import collectives
from lightning_zero.faults.timeouts import extended_during
from lightning_zero.precision.zero_precision import ZeroPrecision
from lightning_zero.resume import ResumeState
from lightning_zero.resume.rng import collect_rng_state
from lightning_zero.strategy.averaging_checkpoints import average_to_load, keep_averages_in_checkpoints
from lightning_zero.strategy.processes import ProcessGroupStrategy, require
from lightning_zero.strategy.sharding import NOT_SHARDED, ShardedModel
from lightning_zero.strategy.swa import clear_schedulers_for_swa


class CheckpointingStrategy(ProcessGroupStrategy):
    """Saving and loading for a sharded model; :class:`~lightning_zero.strategy.zero_strategy.ZeroStrategy` sets
    ``_sharded`` in ``setup``."""

    def __init__(self, zero_config: ZeroConfig, **kwargs: Any) -> None:
        self._sharded: ShardedModel = NOT_SHARDED  # engine, pipeline stages, what this rank holds (sharding.py)
        #: The last fit's sharding and module, while the trainer's optimizers are that fit's (``_states``).
        self._fitted: tuple[ShardedModel, nn.Module] | None = None
        self._resume = ResumeState()  # auto-resume, exact mid-epoch resume, the SIGTERM checkpoint (resume/)
        self._saver: AsyncSaver | None = None  # async_save: exists from setup to teardown of a fit
        super().__init__(zero_config, **kwargs)

    @property
    def _full(self) -> bool:
        return self.zero_config.state_dict_type == "full"

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizer state is restored into shards, which exist only after `setup`.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._resume.on_exception(trainer_of(self.lightning_module), exception)  # the SIGTERM checkpoint
        super().on_exception(exception)

    def setup_checkpoints(self, trainer: pl.Trainer) -> None:
        """Rank 0 removes what interrupted saves left in the checkpoint directories (temporaries only, see
        ``checkpoint/files.py``); ``WeightAveraging`` callbacks save and load through the strategy; with
        ``async_save`` every rank starts its background writer."""
        if self.is_global_zero:
            for callback in trainer.checkpoint_callbacks:
                if isinstance(dirpath := getattr(callback, "dirpath", None), (str, Path)):
                    clean_directory(Path(dirpath))
        self._fitted = (self._sharded, require(self.lightning_module, "lightning_module"))
        keep_averages_in_checkpoints(trainer, self)
        if self.zero_config.async_save:
            self._saver = AsyncSaver(checkpoint_group(self.zero_config.timeout_delta), self.zero_config.timeout_delta)

    def close_checkpoints(self) -> None:
        """Teardown: the writer is normally idle (``on_train_end`` waited); after a failure, no collectives."""
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close(agree=not self._failed)

    # ------------------------------------------------------------------ states
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

    def full_state_dict(self) -> dict[str, Tensor]:
        """The module's unsharded ``state_dict`` on rank 0 (empty elsewhere), trainable parameters at the
        precision the optimizer updates them in. Collective."""
        module = require(self.lightning_module, "lightning_module")
        self._reshard()
        states = self._states()
        return state_dicts.full_model_state(module, states.engine, holding=states.holding)

    def _reshard(self) -> None:
        """Close an accumulation window that keeps stage 3's units gathered (the engine's ``reshard``): a state
        dict, an evaluation loop and the end of training read the module as sharded."""
        if self._sharded.engine is not None:
            self._sharded.engine.reshard()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = require(self.lightning_module, "lightning_module")
        if self._full:
            return self.full_state_dict()
        self._reshard()
        states = self._states()
        return state_dicts.sharded_model_state(module, states.engine, states.holding)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        build = state_dicts.full_optimizer_state if self._full else state_dicts.sharded_optimizer_state
        module = require(self.lightning_module, "lightning_module")
        return build(unwrap(optimizer), module, self._states(optimizers=True).engine)

    # ------------------------------------------------------------------ saving
    @override
    @extended_during("saving a checkpoint")  # rank 0 may write alone while the others wait (faults/timeouts.py)
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint(storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        checkpoint["rng_states"] = collectives.all_gather_objects(collect_rng_state())
        self._resume.on_save(checkpoint, trainer_of(self.lightning_module))  # what a resume replays (resume/state.py)
        hf_model = hf_export.describe(self.lightning_module) if self.lightning_module is not None else None
        if hf_model is not None:
            checkpoint["hf_export"] = hf_model  # what `lightning-zero consolidate --hf` needs
        engine = self._states().engine
        delayed_update.add_to_checkpoint(checkpoint, engine, full=self._full)
        if self._full:
            warn_residuals_not_kept(engine)
            write.save_full(checkpoint, path)  # rank 0 writes; every rank raises if that failed
        elif self._saver is not None:
            error_feedback.add_to_checkpoint(checkpoint, engine)
            self._saver.save(checkpoint, path)  # returns once staged; the next save or teardown waits for it
        else:
            error_feedback.add_to_checkpoint(checkpoint, engine)
            write.save_sharded(checkpoint, path)
        if self.zero_config.gather_16bit_weights_on_save:
            state = self.full_state_dict()
            if self.is_global_zero:
                dtype = (
                    self.precision_plugin.compute_dtype if isinstance(self.precision_plugin, ZeroPrecision) else None
                )
                hf_export.save_16bit(
                    state, hf_model, path, dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
                )
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

    # ------------------------------------------------------------------ loading
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
        optimizers = [] if evaluating else [unwrap(o) for o in self.optimizers]
        average = None if evaluating else average_to_load(trainer)
        checkpoint = io.load(
            path,
            module,
            optimizers,
            self._sharded.engine,
            strict=module.strict_loading,
            weights_only=weights_only is not False,
            holding=self._sharded.holding,
            average=average,
        )
        states = checkpoint.get("rng_states")
        # Put back later in a fit, where the uninterrupted run was: [Note: when the RNG state is restored].
        self._resume.loaded(checkpoint, trainer_of(module), states[self.global_rank % len(states)] if states else None)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        io.load_model_state(
            require(self.lightning_module, "lightning_module"),
            checkpoint["state_dict"],
            self._sharded.engine,
            strict=strict,
            holding=self._sharded.holding,
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        module = require(self.lightning_module, "lightning_module")
        clear_schedulers_for_swa(trainer_of(module))  # Lightning restores the schedulers next
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            io.load_optimizer_state(
                unwrap(optimizer), state, module, self._sharded.engine, holding=self._sharded.holding
            )
        # A full file's parameters one update behind (a sharded directory's were loaded with it, in `io.load`).
        delayed_update.restore(checkpoint.get(delayed_update.KEY), self._sharded.engine)


def trainer_of(module: pl.LightningModule | None) -> pl.Trainer | None:
    return module.trainer if module is not None and module._trainer is not None else None


def unwrap(optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
