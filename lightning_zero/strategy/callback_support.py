"""Lightning callbacks a ZeRO stage cannot serve, refused when the strategy is set up: every rank runs the same
callbacks, so every rank refuses alike, before any parameter is sharded."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelPruning

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig


def refuse_unsupported_callbacks(trainer: pl.Trainer, config: ZeroConfig) -> None:
    """``ModelPruning`` at stage 3 or under pipeline stages: ``torch.nn.utils.prune`` ranks and masks whole tensors
    of every layer and re-registers them (``weight`` -> ``weight_orig`` plus a mask buffer), where stage 3 holds each
    parameter as a DTensor shard that FSDP2 gathers by its registered name, and a pipeline stage holds only its own
    layers (the others are on the meta device). Stages 1-2 hold whole parameters and follow it."""
    if config.stage != 3 and config.pipeline_stages == 1:
        return
    setting = f"stage={config.stage}" if config.stage == 3 else f"pipeline_stages={config.pipeline_stages}"
    held = "DTensor shards" if config.stage == 3 else "the layers of one pipeline stage on each rank"
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if isinstance(callback, ModelPruning):
            raise ZeroConfigError(
                f"ModelPruning is not supported with ZeroStrategy({setting}): pruning masks whole parameters of every "
                f"layer, which this run holds as {held}. Use stage=1 or stage=2 without pipeline stages (whole "
                "parameters, sharded gradients and optimizer state), or prune the consolidated weights after training."
            )
