"""A parsed DeepSpeed config (``config.py``) applied to a run: the precision plugin, the Trainer's
batch and clipping settings, and the optimizer and scheduler built from its sections when
``configure_optimizers`` returns None, as Lightning's DeepSpeed strategy does. A setting given both in the config
and explicitly must agree, or this says which one to drop."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.deepspeed_compat.config import AUTO, OPTIMIZERS, DeepSpeedSettings


def build_optimizer(spec: Mapping[str, Any], params, *, default_lr: float | None = None) -> Optimizer:
    """The torch optimizer a DeepSpeed ``optimizer`` section describes. DeepSpeed's ``Adam`` decouples weight
    decay unless ``adam_w_mode: false`` (so it is torch's AdamW); ``"auto"`` takes the learning rate from the
    LightningModule (``default_lr``) and torch's defaults for the rest."""
    kind, options = spec["type"], dict(spec["params"])
    adam_w = options.pop("adam_w_mode", True)
    options.pop("torch_adam", None)
    name = OPTIMIZERS[kind][0]
    if kind == "adam" and adam_w:
        name = "AdamW"
    if options.get("lr") == AUTO:
        if default_lr is None:
            raise ZeroConfigError(
                'DeepSpeed config: `optimizer.params.lr` is "auto" but the LightningModule has no `learning_rate` '
                "or `lr` attribute or hyperparameter to take it from; give a number."
            )
        options["lr"] = default_lr
    options = {k: (tuple(v) if k == "betas" else v) for k, v in options.items() if v != AUTO}
    return getattr(torch.optim, name)(params, **options)


class DeepSpeedWarmupLR(LRScheduler):
    """DeepSpeed's ``WarmupLR`` / ``WarmupDecayLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` (log or linear), then constant or (with ``total_num_steps``) linear decay back to
    ``warmup_min_lr``, with DeepSpeed's formulas (absolute learning rates; every param group alike)."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        total_num_steps: int | None = None,
    ) -> None:
        self.warmup_min_lr = warmup_min_lr
        self.warmup_max_lr = warmup_max_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        super().__init__(optimizer)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(step + 1) / math.log(self.warmup_num_steps)
            return step / self.warmup_num_steps
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, (self.total_num_steps - step) / max(1.0, self.total_num_steps - self.warmup_num_steps))

    def get_lr(self) -> list[float | torch.Tensor]:
        lr = self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self._gamma(self.last_epoch)
        return [lr for _ in self.optimizer.param_groups]


def build_scheduler(spec: Mapping[str, Any], optimizer: Optimizer, *, total_steps: int | None) -> LRScheduler:
    """The scheduler of a DeepSpeed ``scheduler`` section, stepped once per optimizer step. ``"auto"``:
    ``warmup_max_lr`` is the optimizer's learning rate, ``total_num_steps`` the Trainer's estimate."""
    options = dict(spec["params"])
    options.pop("last_batch_iteration", None)
    if options.get("warmup_max_lr") == AUTO:
        options["warmup_max_lr"] = optimizer.param_groups[0]["lr"]
    if spec["type"] == "WarmupDecayLR":
        if options.get("total_num_steps", AUTO) == AUTO:
            if total_steps is None or not math.isfinite(total_steps):
                raise ZeroConfigError(
                    'DeepSpeed config: `scheduler.params.total_num_steps` is "auto" but the Trainer has no finite '
                    "number of steps; give a number or set `max_steps`."
                )
            options["total_num_steps"] = int(total_steps)
    for key, value in options.items():
        if value == AUTO:
            raise ZeroConfigError(f'DeepSpeed config: `scheduler.params.{key}` cannot be "auto"; give a value.')
    return DeepSpeedWarmupLR(optimizer, **options)


def precision_plugin_for(settings: DeepSpeedSettings | None, plugin):
    """The precision plugin a run uses: the config's ``fp16``/``bf16`` choice in place of Lightning's default,
    or ``plugin`` when the config does not say. Differing explicit choices are an error."""
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import Precision

    from lightning_zero.precision.zero_precision import PrecisionName, ZeroPrecision

    if settings is None or settings.precision is None or plugin is None:
        return plugin  # None: the Trainer has not chosen yet (it hands its choice over later)
    name = str(getattr(plugin, "precision", "32-true"))
    wanted = settings.precision
    if wanted == AUTO:
        if name != "16-mixed" or settings.loss_scale is None:
            return plugin
        wanted = name
    default = type(plugin) in (Precision, FabricPrecision) and name == "32-true"
    if isinstance(plugin, ZeroPrecision) and (name != wanted or settings.loss_scale or settings.reduce_dtype):
        raise ZeroConfigError(
            f"Precision is given both in the DeepSpeed config ({wanted!r}) and as a ZeroPrecision plugin ({name!r}); "
            "set it in one place."
        )
    if not default and name != wanted:
        raise ZeroConfigError(
            f"Precision is given both in the DeepSpeed config ({wanted!r}) and as Trainer(precision={name!r}); "
            "set it in one place."
        )
    if isinstance(plugin, ZeroPrecision):
        return plugin
    scale = settings.loss_scale if wanted == "16-mixed" else None
    kwargs: dict[str, Any] = {}
    if scale is not None:
        kwargs = dict(
            initial_scale=scale.initial_scale,
            growth_factor=scale.growth_factor,
            backoff_factor=scale.backoff_factor,
            growth_interval=scale.growth_interval,
            hysteresis=scale.hysteresis,
            min_scale=scale.min_scale,
            dynamic_loss_scale=scale.dynamic,
        )
    if settings.reduce_dtype is not None and wanted in ("16-mixed", "bf16-mixed"):
        kwargs["reduce_dtype"] = settings.reduce_dtype
    return ZeroPrecision(cast(PrecisionName, wanted), **kwargs)  # the names config.py's _precision gives


def apply_to_trainer(settings: DeepSpeedSettings | None, trainer) -> None:
    """Gradient clipping and accumulation from the config, where the Trainer was left at its defaults."""
    if settings is None:
        return
    clip = settings.gradient_clip_val
    if clip is not None and clip != AUTO:
        if trainer.gradient_clip_val is None:
            trainer.gradient_clip_val = clip
        elif float(trainer.gradient_clip_val) != clip:
            raise ZeroConfigError(
                f"Gradient clipping is given both in the DeepSpeed config (gradient_clipping={clip}) and as "
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}); set it in one place."
            )
    steps = settings.accumulate_grad_batches
    if steps is not None and steps != AUTO:
        if trainer.accumulate_grad_batches == 1:
            trainer.accumulate_grad_batches = steps
        elif trainer.accumulate_grad_batches != steps:
            raise ZeroConfigError(
                f"Gradient accumulation is given both in the DeepSpeed config (gradient_accumulation_steps={steps}) "
                f"and as Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}); set it in one place."
            )


def check_batch_sizes(
    settings: DeepSpeedSettings | None, trainer, loader: object = None, world_size: int | None = None
) -> None:
    """``train_micro_batch_size_per_gpu`` and ``train_batch_size`` must describe the run's data loader
    (``loader``, else the trainer's; ``world_size``, else the trainer's): the batch size is the data's, so a config
    that disagrees is an error rather than a silent change."""
    if settings is None or {settings.micro_batch_size, settings.train_batch_size} <= {None, AUTO}:
        return
    loader = trainer.train_dataloader if loader is None else loader
    world_size = trainer.world_size if world_size is None else world_size
    batch = getattr(loader, "batch_size", None)
    if batch is None:
        return  # not a plain DataLoader: nothing to compare with
    micro = settings.micro_batch_size
    if micro not in (None, AUTO) and micro != batch:
        raise ZeroConfigError(
            f"DeepSpeed config: `train_micro_batch_size_per_gpu={micro}` but the training DataLoader's batch_size "
            f'is {batch}; make them agree (or use "auto").'
        )
    total = settings.train_batch_size
    expected = batch * trainer.accumulate_grad_batches * world_size
    if total not in (None, AUTO) and total != expected:
        raise ZeroConfigError(
            f"DeepSpeed config: `train_batch_size={total}` but batch {batch} x accumulation "
            f"{trainer.accumulate_grad_batches} x {world_size} data-parallel replicas = {expected}."
        )


def module_learning_rate(module) -> float | None:
    """A LightningModule's learning rate, by Lightning's tuner conventions (attribute or hyperparameter)."""
    for name in ("learning_rate", "lr"):
        value = getattr(module, name, None)
        if value is None:
            value = getattr(module, "hparams", {}).get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def optimizers_from_config(settings: DeepSpeedSettings, module, trainer, from_module) -> tuple[list, list]:
    """Optimizers and LR scheduler configs of a run whose DeepSpeed config has ``optimizer``/``scheduler``
    sections: the config's optimizer when ``configure_optimizers`` returns None (as with Lightning's DeepSpeed
    strategy), else ``from_module()``'s; the config's scheduler on top. Both sources at once is an error."""
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    if settings.optimizer is not None:
        if module.configure_optimizers() is not None:
            raise ZeroConfigError(
                "The optimizer is given both in the DeepSpeed config (`optimizer`) and by "
                f"{type(module).__name__}.configure_optimizers; return None from it, or drop the section."
            )
        params = [p for p in module.parameters() if p.requires_grad]
        optimizers = [build_optimizer(settings.optimizer, params, default_lr=module_learning_rate(module))]
        schedulers: list = []
    else:
        optimizers, schedulers = from_module()
    if settings.scheduler is not None:
        if schedulers or len(optimizers) != 1:
            raise ZeroConfigError(
                "The LR scheduler is given both in the DeepSpeed config (`scheduler`) and by configure_optimizers "
                "(or there are several optimizers); set it in one place."
            )
        scheduler = build_scheduler(settings.scheduler, optimizers[0], total_steps=trainer.estimated_stepping_batches)
        schedulers = [LRSchedulerConfig(scheduler, interval="step")]
    return optimizers, schedulers
