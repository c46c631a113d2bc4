"""The Lightning callbacks and hooks a ZeRO run is given: those a stage cannot serve are refused when the strategy is
set up (every rank runs the same callbacks, so every rank refuses alike, before any parameter is sharded), and those
that may change gradients keep the offloaded host step after backward."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig


def refuse_unsupported_callbacks(trainer: pl.Trainer, config: ZeroConfig) -> None:
    """``ModelPruning`` at stage 3 or under pipeline stages: ``torch.nn.utils.prune`` ranks and masks whole tensors
    of every layer and re-registers them (``weight`` -> ``weight_orig`` plus a mask buffer), where stage 3 holds each
    parameter as a DTensor shard that FSDP2 gathers by its registered name, and a pipeline stage holds only its own
    layers (the others are on the meta device). Stages 1-2 hold whole parameters and follow it."""
    if not config.shards_parameters and config.pipeline_stages == 1:
        return
    if config.shards_parameters:
        setting, held = f"stage={config.stage}", "DTensor shards"
    else:
        setting, held = f"pipeline_stages={config.pipeline_stages}", "the layers of one pipeline stage on each rank"
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if isinstance(callback, ModelPruning):
            raise ZeroConfigError(
                f"ModelPruning is not supported with ZeroStrategy({setting}): pruning masks whole parameters of every "
                f"layer, which this run holds as {held}. Use stage=1 or stage=2 without pipeline stages (whole "
                "parameters, sharded gradients and optimizer state), or prune the consolidated weights after training."
            )


#: The hooks between backward and the optimizer step, whose code may change the gradients the step uses.
_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def may_change_gradients(module: pl.LightningModule, callbacks: list[pl.Callback]) -> bool:
    """Whether the module or a callback (other than this package's, which only read) runs code of its own in a hook
    between backward and the step, e.g. clipping with ``torch.nn.utils.clip_grad_norm_``: a host step started during
    backward would not see what it does to the gradients."""
    return any(is_overridden(hook, module, pl.LightningModule) for hook in _GRADIENT_HOOKS) or any(
        is_overridden(hook, callback, pl.Callback)
        for callback in callbacks
        if type(callback).__module__.partition(".")[0] != "lightning_zero"
        for hook in _GRADIENT_HOOKS
    )
