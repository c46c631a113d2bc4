"""Dynamic loss scaling for ``"16-mixed"``: the arithmetic only, no tensors or processes.

fp16 represents magnitudes down to about 6e-8, and many gradients are smaller than that. Multiplying the loss by
a large scale keeps them representable through backward; the gradients are divided by it again (in fp32)
before clipping and the step. A scale that is too large overflows to inf/NaN: that step is skipped on every
rank and the scale is lowered. After ``growth_interval`` clean steps it is raised again.

The schedule is torch's ``GradScaler`` (same defaults) plus DeepSpeed's ``hysteresis`` (tolerate that many
overflows before backing off) and ``min_scale``; :meth:`LossScaleConfig.from_deepspeed` maps DeepSpeed's
``fp16`` section onto it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


class LossScaleConfigError(ValueError):
    """A loss-scaling setting is out of range."""


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """How the loss scale starts and moves. Defaults are ``torch.amp.GradScaler``'s."""

    initial_scale: float = 2.0**16
    """Scale of the first step."""
    growth_factor: float = 2.0
    """Multiplier applied after ``growth_interval`` consecutive steps without overflow."""
    backoff_factor: float = 0.5
    """Multiplier applied on overflow (once ``hysteresis`` overflows have been tolerated)."""
    growth_interval: int = 2000
    """Consecutive overflow-free steps before the scale grows (DeepSpeed: ``loss_scale_window``)."""
    hysteresis: int = 1
    """Overflows tolerated before the scale backs off; 1 backs off on every overflow, as GradScaler does."""
    min_scale: float = 1.0
    """The scale never goes below this."""
    dynamic: bool = True
    """False keeps ``initial_scale`` fixed (DeepSpeed ``loss_scale > 0``); overflowing steps are still skipped."""

    def __post_init__(self) -> None:
        checks = {
            "initial_scale": self.initial_scale > 0,
            "growth_factor": self.growth_factor >= 1.0,
            "backoff_factor": 0.0 < self.backoff_factor < 1.0,
            "growth_interval": isinstance(self.growth_interval, int) and self.growth_interval >= 1,
            "hysteresis": isinstance(self.hysteresis, int) and self.hysteresis >= 1,
            "min_scale": 0 < self.min_scale <= self.initial_scale,
        }
        allowed = {
            "initial_scale": "> 0",
            "growth_factor": ">= 1",
            "backoff_factor": "in (0, 1)",
            "growth_interval": "an integer >= 1",
            "hysteresis": "an integer >= 1",
            "min_scale": "in (0, initial_scale]",
        }
        for name, ok in checks.items():
            if not ok:
                raise LossScaleConfigError(
                    f"Loss scaling setting `{name}={getattr(self, name)!r}` is invalid: it must be {allowed[name]}."
                )

    #: DeepSpeed ``fp16`` keys we understand (``enabled`` and ``auto_cast`` only select the mode).
    DEEPSPEED_KEYS = (
        "enabled",
        "auto_cast",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
    )

    @classmethod
    def from_deepspeed(cls, fp16: Mapping[str, Any]) -> LossScaleConfig:
        """DeepSpeed's ``"fp16": {...}`` section. ``loss_scale: 0`` (the default) means dynamic scaling
        starting at ``2**initial_scale_power``; a positive ``loss_scale`` is a fixed scale."""
        unknown = sorted(set(fp16) - set(cls.DEEPSPEED_KEYS))
        if unknown:
            raise LossScaleConfigError(
                f"Unsupported key(s) {unknown} in the DeepSpeed `fp16` section; supported: {list(cls.DEEPSPEED_KEYS)}."
            )
        if fp16.get("consecutive_hysteresis", False):
            raise LossScaleConfigError("DeepSpeed `fp16.consecutive_hysteresis: true` is not supported; remove it.")
        static = float(fp16.get("loss_scale", 0.0))
        initial = static if static > 0 else 2.0 ** float(fp16.get("initial_scale_power", 16))
        return cls(
            initial_scale=initial,
            growth_interval=int(fp16.get("loss_scale_window", 1000)),
            hysteresis=int(fp16.get("hysteresis", 2)),
            min_scale=min(float(fp16.get("min_loss_scale", 1.0)), initial),
            dynamic=static <= 0,
        )


class DynamicLossScaler:
    """The current scale and the counters that move it; ``state_dict`` goes into checkpoints."""

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self.scale = float(self.config.initial_scale)
        self.growth_tracker = 0
        """Consecutive overflow-free steps since the scale last changed."""
        self.hysteresis_left = self.config.hysteresis
        self.skipped_steps = 0
        """Steps skipped because of an overflow, over the whole run."""

    def update(self, found_inf: bool) -> float:
        """Advance by one optimizer step; returns the scale the next step uses."""
        c = self.config
        if found_inf:
            self.skipped_steps += 1
            self.growth_tracker = 0
            if not c.dynamic:
                return self.scale
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * c.backoff_factor, c.min_scale)
                self.hysteresis_left = c.hysteresis
            return self.scale
        if not c.dynamic:
            return self.scale
        self.growth_tracker += 1
        if self.growth_tracker >= c.growth_interval:
            self.scale *= c.growth_factor
            self.growth_tracker = 0
            self.hysteresis_left = c.hysteresis
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state.get("hysteresis_left", self.config.hysteresis))
        self.skipped_steps = int(state.get("skipped_steps", 0))
