"""Helpers the CLI tests name by class path: a callback that records what a run did, and a GPT that leaves
its optimizer to a DeepSpeed config."""

from __future__ import annotations

import math

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.demo import GPTLightningModule


def describe_run(trainer: L.Trainer) -> dict:
    """The settings a run ended up with, whoever set them (CLI, YAML, DeepSpeed JSON or Python)."""
    strategy = trainer.strategy
    plugin = strategy.precision_plugin
    optimizer = trainer.optimizers[0]
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return {
        "strategy": type(strategy).__name__,
        "zero_config": repr(getattr(strategy, "zero_config", None)),
        "precision": str(plugin.precision),
        "loss_scale": repr(getattr(getattr(plugin, "scaler", None), "config", None)),
        "clip": trainer.gradient_clip_val,
        "accumulate": trainer.accumulate_grad_batches,
        "world_size": trainer.world_size,
        "max_steps": trainer.max_steps,
        "global_step": trainer.global_step,
        "val_check_interval": trainer.val_check_interval,
        "limit_val_batches": trainer.limit_val_batches,
        "optimizer": type(optimizer).__name__,
        "param_group": repr(sorted(group.items())),
        "schedulers": [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs],
        "model": _hparams(trainer.lightning_module),
        "data": _hparams(trainer.datamodule),
        "val_loss": float(trainer.callback_metrics.get("val_loss", math.nan)),
        "progress_bar": sorted(trainer.progress_bar_metrics),
    }


def _hparams(holder) -> dict:
    """Constructor arguments, without the `_class_path`/`_instantiator` LightningCLI adds; tuples as lists."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in holder.hparams.items() if not k.startswith("_")}


class RecordRun(L.Callback):
    """At the end of fit, rank 0 saves the full trained parameters and :func:`describe_run` to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        state = strategy.full_state_dict() if isinstance(strategy, ZeroStrategy) else pl_module.state_dict()
        if trainer.is_global_zero:
            params = {k: v.detach().cpu().clone() for k, v in state.items()}
            torch.save({"state": params, "info": describe_run(trainer)}, self.path)


class OptimizerFromConfigGPT(GPTLightningModule):
    """The demo GPT without an optimizer of its own: a DeepSpeed config's `optimizer`/`scheduler` build them."""

    def configure_optimizers(self):
        return None
