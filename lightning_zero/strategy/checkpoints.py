"""Saving and loading a sharded model over the ``checkpoint/`` package: what a Lightning front end drives, the
``Trainer`` strategy as a Fabric one would. It takes plain values (the module, the optimizers, the sharding, paths),
never a ``Trainer``; what a ``Trainer`` adds (its RNG and resume entries, weight averaging) the strategy adds.

One writer runs per save (full, sharded, or in the background with ``async_save``), with the 16-bit export beside it
when asked. States and loads cover the tensors this rank holds (``ShardedModel.holding``) through the engine's shard
records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.checkpoint import (
    delayed_update,
    error_feedback,
    hf_export,
    io,
    selective_updates,
    state_dicts,
    write,
)
from lightning_zero.checkpoint.async_save import AsyncSaver, checkpoint_group
from lightning_zero.checkpoint.error_feedback import warn_residuals_not_kept
from lightning_zero.checkpoint.files import clean_directory, remove
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.strategy.sharding import ShardedModel


class ShardedCheckpoints:
    """The checkpoints of one strategy: its writer (and, with ``async_save``, the background saver from the start of
    a fit to its teardown), and the states and loads of a sharded module and its optimizers."""

    def __init__(self, zero_config: ZeroConfig) -> None:
        self.zero_config = zero_config
        self._saver: AsyncSaver | None = None

    @property
    def full(self) -> bool:
        """One plain file written by rank 0 (``state_dict_type="full"``), rather than every rank's shards."""
        return self.zero_config.state_dict_type == "full"

    def open(self, directories: Iterable[Path], is_global_zero: bool) -> None:
        """Rank 0 removes what interrupted saves left in ``directories`` (temporaries only, see
        ``checkpoint/files.py``); with ``async_save`` every rank starts its background writer."""
        if is_global_zero:
            for directory in directories:
                clean_directory(directory)
        if self.zero_config.async_save:
            self._saver = AsyncSaver(checkpoint_group(self.zero_config.timeout_delta), self.zero_config.timeout_delta)

    def close(self, agree: bool) -> None:
        """Teardown: the writer is normally idle (the end of training waited); after a failure (``agree=False``),
        no collectives."""
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.close(agree=agree)

    # ------------------------------------------------------------------ states
    def full_model_state(self, module: nn.Module, sharded: ShardedModel) -> dict[str, Tensor]:
        """The module's unsharded ``state_dict`` on rank 0 (empty elsewhere), trainable parameters at the precision
        the optimizer updates them in. Collective; the caller has closed any gathered window (the engine's
        ``reshard``)."""
        return state_dicts.full_model_state(module, sharded.engine, holding=sharded.holding)

    def model_state(self, module: nn.Module, sharded: ShardedModel) -> dict[str, Any]:
        """What a checkpoint holds of the module: the full state on rank 0, or this rank's shards."""
        if self.full:
            return self.full_model_state(module, sharded)
        return state_dicts.sharded_model_state(module, sharded.engine, sharded.holding)

    def optimizer_state(self, optimizer: Optimizer, module: nn.Module, sharded: ShardedModel) -> dict[str, Any]:
        build = state_dicts.full_optimizer_state if self.full else state_dicts.sharded_optimizer_state
        return build(unwrap(optimizer), module, sharded.engine)

    # ------------------------------------------------------------------ saving
    def save(
        self,
        checkpoint: dict[str, Any],
        path: Path,
        module: nn.Module | None,
        sharded: ShardedModel,
        full_model_state: Callable[[], dict[str, Tensor]],
        compute_dtype: torch.dtype | None,
        is_global_zero: bool,
        barrier: Callable[[], None],
    ) -> None:
        """Write ``checkpoint`` (Lightning's dictionary, the strategy's entries added) to ``path`` on every rank, and
        the 16-bit export beside it with ``gather_16bit_weights_on_save`` (``full_model_state`` gathers the weights,
        ``compute_dtype`` theirs when 16-bit). Collective."""
        hf_model = hf_export.describe(module) if module is not None else None
        if hf_model is not None:
            checkpoint["hf_export"] = hf_model  # what `lightning-zero consolidate --hf` needs
        engine = sharded.engine
        delayed_update.add_to_checkpoint(checkpoint, engine, full=self.full)
        selective_updates.add_to_checkpoint(checkpoint, engine, full=self.full)
        if self.full:
            warn_residuals_not_kept(engine)
            write.save_full(checkpoint, path)  # rank 0 writes; every rank raises if that failed
        elif self._saver is not None:
            error_feedback.add_to_checkpoint(checkpoint, engine)
            self._saver.save(checkpoint, path)  # returns once staged; the next save or teardown waits for it
        else:
            error_feedback.add_to_checkpoint(checkpoint, engine)
            write.save_sharded(checkpoint, path)
        if self.zero_config.gather_16bit_weights_on_save:
            state = full_model_state()
            if is_global_zero:
                dtype = compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
                hf_export.save_16bit(state, hf_model, path, dtype)
            barrier()

    def wait(self) -> None:
        """With ``async_save``: block until the save in flight (if any) is complete, and raise its failure on every
        rank. Collective."""
        if self._saver is not None:
            self._saver.wait()

    def remove(self, path: Path, is_global_zero: bool) -> None:
        """Rank 0 removes a checkpoint and its 16-bit export; with ``async_save`` once the save in flight has
        succeeded (never the newest complete checkpoint)."""
        if is_global_zero:
            removal = self._saver.remove if self._saver is not None else remove
            for target in (path, hf_export.sixteen_bit_dir(path)):
                removal(target)

    # ------------------------------------------------------------------ loading
    def load(
        self,
        path: Path,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        sharded: ShardedModel,
        strict: bool,
        weights_only: bool,
        average: dict[str, Tensor] | None,
    ) -> dict[str, Any]:
        """Read ``path`` into ``module`` and ``optimizers`` (none: the model alone) and return the rest of the
        checkpoint; ``average``: the tensors a sharded directory's weight average is read into."""
        return io.load(
            path,
            module,
            [unwrap(o) for o in optimizers],
            sharded.engine,
            strict=strict,
            weights_only=weights_only,
            holding=sharded.holding,
            average=average,
        )

    def load_model_state(
        self, module: nn.Module, state_dict: Mapping[str, Any], sharded: ShardedModel, strict: bool
    ) -> None:
        io.load_model_state(module, state_dict, sharded.engine, strict=strict, holding=sharded.holding)

    def load_optimizer_states(
        self, optimizers: Sequence[Optimizer], checkpoint: Mapping[str, Any], module: nn.Module, sharded: ShardedModel
    ) -> None:
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
            io.load_optimizer_state(unwrap(optimizer), state, module, sharded.engine, holding=sharded.holding)
        # A full file's parameters one update behind (a sharded directory's were loaded with it, in `io.load`).
        delayed_update.restore(checkpoint.get(delayed_update.KEY), sharded.engine)
        selective_updates.restore(checkpoint.get(selective_updates.KEY), sharded.engine)


def unwrap(optimizer: Optimizer | LightningOptimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
