"""ZeRO in one line: any LightningModule, `Trainer(strategy="zero2")`, 2 CPU processes.

    python examples/quickstart.py

A small classifier of points in 2-D (which of 4 interleaved spirals a point lies on), trained with ZeRO
stage 2: optimizer state and gradients are sharded over the 2 ranks, nothing else in the code changes.
Swap in "zero1", "zero3", "zero2_offload" or "zero3_offload" and it runs the same.
"""

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the strategy names zero1 ... zero3_offload)


def spirals(n: int, arms: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, arms, (n,), generator=g)
    radius = torch.rand(n, generator=g)
    angle = 3 * radius * math.pi + label * 2 * math.pi / arms
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return TensorDataset(points + 0.02 * torch.randn(n, 2, generator=g), label)


class SpiralClassifier(L.LightningModule):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4)
        )
        self.first_loss: float | None = None

    def training_step(self, batch, batch_idx):
        points, label = batch
        loss = F.cross_entropy(self.net(points), label)
        if self.first_loss is None:
            self.first_loss = float(loss.detach())  # detached: a number, not a tensor that needs a gradient
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


if __name__ == "__main__":  # Lightning's launcher re-runs this file in the second process
    L.seed_everything(0, verbose=False)
    model = SpiralClassifier()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="zero2",
        max_steps=300,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(spirals(8192), batch_size=64, shuffle=True))
    if trainer.is_global_zero:
        print(f"loss {model.first_loss:.2f} -> {float(trainer.callback_metrics['train_loss']):.2f}")
