"""The model and the plain single-process reference of tests/distributed/test_pipeline_trainer.py.

Every run sees global batches of 8 samples (8 per replica with one pipeline, 4 with two), so one reference
serves every layout: with gradient accumulation 2, clipping by norm, two param groups and a StepLR.
"""

from __future__ import annotations

import copy

import lightning as L
import torch
from torch import nn

from lightning_zero.engine.comm import collectives
from tests.distributed import models

GLOBAL_BATCH, ACCUMULATE, CLIP, STEPS_PER_EPOCH = 8, 2, 0.5, 4  # 64 samples / 8 / 2
WIDTH = 12


class RoutedInput(nn.Module):
    """The first layer as two experts: the samples whose first feature exceeds a threshold go to ``rare``. Over
    the reference's first step, the first micro-batch sends one sample there and the second none, so an
    accumulation window gives ``rare`` a gradient and then a micro-batch in which no rank uses it. Routed per
    sample, the result does not depend on how the batch is cut into micro-batches."""

    THRESHOLD = 2.25

    def __init__(self) -> None:
        super().__init__()
        self.common, self.rare = nn.Linear(models.IN, WIDTH), nn.Linear(models.IN, WIDTH)

    @classmethod
    def routed(cls, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0] > cls.THRESHOLD

    def forward(self, x):
        out, mask = self.common(x), self.routed(x)
        if mask.any():  # no call at all otherwise: ``rare`` gets no gradient, as with any expert nobody picks
            out = out.clone()
            out[mask] = self.rare(x[mask])
        return out


class Chain(L.LightningModule):
    """An ordinary LightningModule whose model is an ``nn.Sequential``: 8 layers to cut into stages (the first
    two experts when ``routed``)."""

    def __init__(self, routed: bool = False) -> None:
        super().__init__()
        self.routed = routed
        blocks = [nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(5)]
        first = RoutedInput() if routed else nn.Linear(models.IN, WIDTH)
        self.layers = nn.Sequential(first, *blocks, nn.LayerNorm(WIDTH), nn.Linear(WIDTH, models.OUT))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):  # the run without pipelining
        loss = self.pipeline_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self(batch[0]), batch[1])
        self.log("val_loss", loss, sync_dist=True)

    def pipeline_layers(self):
        return self.layers

    def pipeline_loss(self, output, target):
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self):
        opt, sched = models.make_optimizer(self)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def initial_state(routed: bool = False) -> dict:
    torch.manual_seed(3)
    return copy.deepcopy(Chain(routed).state_dict())


def reference(steps: int, grads: list | None = None, routed: bool = False) -> tuple[dict, list[float], float]:
    """Parameters after ``steps`` optimizer steps, every batch's loss, and the loss on the two validation
    batches; each step's gradients (before clipping) appended to ``grads``."""
    model = Chain(routed)
    model.load_state_dict(initial_state(routed))
    opt, sched = models.make_optimizer(model)
    data = models.IndexedData()
    batches = models.global_microbatches(data, 1, GLOBAL_BATCH, steps * ACCUMULATE)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(ACCUMULATE):
            ((x, y),) = batches[step * ACCUMULATE + micro]
            loss = nn.functional.mse_loss(model(x), y)
            (loss / ACCUMULATE).backward()
            losses.append(float(loss))
        if grads is not None:
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
    with torch.no_grad():
        val = [nn.functional.mse_loss(model(x), y) for x, y in val_batches()]
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, losses, float(sum(val) / len(val))


def routed_samples(steps: int) -> list[int]:
    """How many samples of each of the reference's micro-batches go to :class:`RoutedInput`'s ``rare`` expert."""
    batches = models.global_microbatches(models.IndexedData(), 1, GLOBAL_BATCH, steps * ACCUMULATE)
    return [int(RoutedInput.routed(x).sum()) for ((x, _),) in batches]


def val_batches() -> list:
    data = models.IndexedData()
    return [tuple(torch.stack(t) for t in zip(*(data[i] for i in range(j * 8, j * 8 + 8)))) for j in range(2)]


def loader(replicas: int):
    return models.loader(models.IndexedData(), GLOBAL_BATCH // replicas)


def val_loader(replicas: int):
    # Sequential, so every layout validates on the same two global batches.
    return torch.utils.data.DataLoader(models.IndexedData(16), batch_size=GLOBAL_BATCH // replicas)


def held_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's parameters, from the ranks that hold each stage (stage 3: gathered over its replicas)."""
    from torch.distributed.tensor import DTensor

    mine = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for n, t in module.state_dict().items()
        if not t.is_meta
    }
    merged: dict[str, torch.Tensor] = {}
    for part in collectives.all_gather_objects(mine):
        merged.update(part)
    return merged
