"""ZeroPrecision: the precision plugin ZeroStrategy runs with.

It owns the part of the optimizer step where precision and sharding meet: gradients are *finalized*
(averaged over ranks, see [Note: gradients are held as sums until finalized]) before any hook, clipping or
the step sees them, and clipping by norm uses the global norm over every rank's shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.config import check_choice
from lightning_zero.engine import collectives

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED_PRECISION = ("32-true",)


def _unwrap(optimizer) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)


class ZeroPrecision(Precision):
    """Precision plugin for :class:`~lightning_zero.ZeroStrategy`.

    ``Trainer(precision=...)`` selects it automatically; it can also be passed as
    ``Trainer(plugins=[ZeroPrecision("32-true")])``.
    """

    def __init__(self, precision: PrecisionName = "32-true") -> None:
        check_choice("precision", precision, SUPPORTED_PRECISION)
        self.precision = precision
        self._engine = None

    def attach(self, engine) -> None:
        """Called by the strategy once the sharding engine exists."""
        self._engine = engine

    @property
    def engine(self):
        if self._engine is None:
            raise RuntimeError("ZeroPrecision is used without ZeroStrategy; pass `strategy=ZeroStrategy(...)`.")
        return self._engine

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(
        self, optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        optimizer = _unwrap(optimizer)
        closure_result = closure()
        self.engine.finalize_gradients(optimizer)
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            # `training_step` returned None: Lightning skips the step; drop what was accumulated.
            self.engine.discard_gradients(optimizer)
            return None
        return self.engine.step(optimizer, **kwargs)

    # ------------------------------------------------------------------ clipping
    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        optimizer = _unwrap(optimizer)
        self.engine.finalize_gradients(optimizer)
        grads = self.engine.local_gradients(optimizer)
        total = global_grad_norm(grads, device=_device_of(optimizer))
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        optimizer = _unwrap(optimizer)
        self.engine.finalize_gradients(optimizer)
        for grad in self.engine.local_gradients(optimizer):
            grad.clamp_(-clip_val, clip_val)


def _device_of(optimizer: Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def global_grad_norm(local_grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 2-norm of the full gradient, from this rank's non-overlapping shards (one scalar all-reduce)."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    if local_grads:
        norms = torch._foreach_norm([g.float() for g in local_grads], 2.0)
        squares = squares + torch.stack([n.double() for n in norms]).pow(2).sum()
    collectives.all_reduce(squares)
    return squares.sqrt().float()
