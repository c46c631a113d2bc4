"""Demo model and data used by the examples, benchmarks and tests of lightning_zero."""

from __future__ import annotations

from lightning_zero.demo.bert import MaskedLMLightningModule
from lightning_zero.demo.callbacks import LossReport
from lightning_zero.demo.data import CharDataModule, RandomTokenDataModule
from lightning_zero.demo.gpt import GPT, Block, GPTConfig, GPTLightningModule, count_parameters
from lightning_zero.demo.vision import GratingsDataModule, ResNetClassifier

__all__ = [
    "GPT",
    "Block",
    "CharDataModule",
    "GPTConfig",
    "GPTLightningModule",
    "GratingsDataModule",
    "LossReport",
    "MaskedLMLightningModule",
    "RandomTokenDataModule",
    "ResNetClassifier",
    "count_parameters",
]
