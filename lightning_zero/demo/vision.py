"""A small ResNet image classifier and generated images to train it on (nothing downloaded).

``GratingsDataModule`` draws 3x16x16 images of sinusoidal gratings: the class fixes the orientation (one of
``num_classes`` angles), while phase, frequency, colour and noise vary per image. A CNN must learn
orientation-selective filters to tell them apart, which a ResNet does within a few hundred steps.
"""

from __future__ import annotations

import math
from typing import Any, cast

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities import AttributeDict
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


def gratings(num_samples: int, num_classes: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images ``(N, 3, size, size)``, labels ``(N,)``), deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (num_samples,), generator=g)
    angle = labels.float() * math.pi / num_classes  # (N,)
    frequency = 0.6 + 0.6 * torch.rand(num_samples, generator=g)  # radians per pixel
    phase = 2 * math.pi * torch.rand(num_samples, generator=g)
    coords = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    y, x = torch.meshgrid(coords, coords, indexing="ij")  # (S, S)
    along = x[None] * torch.cos(angle)[:, None, None] + y[None] * torch.sin(angle)[:, None, None]  # (N, S, S)
    wave = torch.sin(frequency[:, None, None] * along + phase[:, None, None])  # (N, S, S)
    colour = 0.5 + 0.5 * torch.rand(num_samples, 3, generator=g)  # (N, 3)
    images = colour[:, :, None, None] * wave[:, None] + 0.3 * torch.randn(num_samples, 3, size, size, generator=g)
    return images, labels


class GratingsDataModule(L.LightningDataModule):
    """Train, validation and test splits of :func:`gratings` (different seeds, so no image repeats)."""

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 16,
        batch_size: int = 32,
        num_train: int = 4096,
        num_val: int = 512,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.splits: dict[str, TensorDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        hp = cast(AttributeDict, self.hparams)
        if not self.splits:
            for name, count, offset in (("train", hp.num_train, 0), ("val", hp.num_val, 1), ("test", hp.num_val, 2)):
                self.splits[name] = TensorDataset(*gratings(count, hp.num_classes, hp.image_size, hp.seed * 3 + offset))

    def train_dataloader(self) -> DataLoader:
        batch_size = cast(AttributeDict, self.hparams).batch_size
        return DataLoader(self.splits["train"], batch_size=batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        batch_size = cast(AttributeDict, self.hparams).batch_size
        return DataLoader(self.splits["val"], batch_size=batch_size)

    def test_dataloader(self) -> DataLoader:
        batch_size = cast(AttributeDict, self.hparams).batch_size
        return DataLoader(self.splits["test"], batch_size=batch_size)


class BasicBlock(nn.Module):
    """ResNet's two-convolution residual block, with a 1x1 projection when the shape changes."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A stem convolution, stages of :class:`BasicBlock` (each stage halves the resolution and doubles the
    width), global average pooling and a linear classifier."""

    def __init__(self, num_classes: int, width: int = 16, blocks_per_stage: tuple[int, ...] = (1, 1, 1)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, channels = [], width
        for i, count in enumerate(blocks_per_stage):
            out = width * 2**i
            for j in range(count):
                layers.append(BasicBlock(channels, out, stride=2 if i and not j else 1))
                channels = out
        self.blocks = nn.ModuleList(layers)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


class ResNetClassifier(L.LightningModule):
    """Cross-entropy training of :class:`ResNet` with SGD + momentum and a cosine schedule; accuracy on
    validation and test through torchmetrics (synchronised across ranks)."""

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 16,
        blocks_per_stage: tuple[int, ...] = (1, 1, 1),
        learning_rate: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        max_steps: int = 300,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ResNet(num_classes, width, tuple(blocks_per_stage))
        self.val_accuracy = MulticlassAccuracy(num_classes)
        self.test_accuracy = MulticlassAccuracy(num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], split: str, metric: MulticlassAccuracy) -> None:
        images, labels = batch
        logits = self(images)
        metric.update(logits, labels)
        self.log(f"{split}_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log(f"{split}_acc", metric, prog_bar=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy)

    def configure_optimizers(self) -> Any:
        hp = cast(AttributeDict, self.hparams)
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hp.learning_rate, momentum=hp.momentum, weight_decay=hp.weight_decay
        )
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=hp.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}
