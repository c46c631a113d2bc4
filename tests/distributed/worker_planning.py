"""Rank program for the planner's calibration: each case trains a real 2-rank run with the peak of live tensor
bytes measured (``planning/measure.py``), and rank 0 compares it with the prediction from a traced step
(``planning/trace.py`` + ``planning/predict.py``).

Groups: ``calibration`` (the matrix of cases), ``budget`` (a plan's pick run within its budget).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.demo.data import RandomTokenDataset
from lightning_zero.demo.gpt import Block, GPTLightningModule
from lightning_zero.demo.vision import BasicBlock, ResNetClassifier
from lightning_zero.planning.measure import PeakMemory
from lightning_zero.planning.predict import Configuration, predict
from lightning_zero.planning.trace import trace_step
from tests.distributed import models
from tests.distributed.worker_core import RANK, WORLD, trainer
from tests.launch import run_cases_with_directory

GPT = dict(vocab_size=34, block_size=64, n_layer=4, n_head=4, n_embd=128)  # conf/model/gpt_small.yaml
RESNET = dict(num_classes=10, width=16, blocks_per_stage=(1, 1, 1))  # conf/model/resnet_small.yaml

#: name -> (model, stage, precision, micro-batch, activation checkpointing, offload_optimizer, offload_params[,
#: optimizer_state_dtype])
CASES = {
    "gpt_s1_fp32_b8": ("gpt", 1, "32-true", 8, False, 0.0, False),
    "gpt_s2_fp32_b8": ("gpt", 2, "32-true", 8, False, 0.0, False),
    "gpt_s3_fp32_b8": ("gpt", 3, "32-true", 8, False, 0.0, False),
    "gpt_s1_fp32_b8_ac": ("gpt", 1, "32-true", 8, True, 0.0, False),
    "gpt_s2_fp32_b8_ac": ("gpt", 2, "32-true", 8, True, 0.0, False),
    "gpt_s3_fp32_b8_ac": ("gpt", 3, "32-true", 8, True, 0.0, False),
    "gpt_s1_bf16_b8": ("gpt", 1, "bf16-mixed", 8, False, 0.0, False),
    "gpt_s2_bf16_b8": ("gpt", 2, "bf16-mixed", 8, False, 0.0, False),
    "gpt_s3_bf16_b8": ("gpt", 3, "bf16-mixed", 8, False, 0.0, False),
    "gpt_s2_fp32_b16": ("gpt", 2, "32-true", 16, False, 0.0, False),
    "gpt_s3_fp32_b16_ac": ("gpt", 3, "32-true", 16, True, 0.0, False),
    "gpt_s2_fp32_b8_offload": ("gpt", 2, "32-true", 8, False, 1.0, False),
    "gpt_s3_fp32_b8_offload": ("gpt", 3, "32-true", 8, False, 1.0, False),
    "gpt_s2_fp32_b8_offload0.5": ("gpt", 2, "32-true", 8, False, 0.5, False),
    "gpt_s3_bf16_b16_ac": ("gpt", 3, "bf16-mixed", 16, True, 0.0, False),
    "gpt_s1_bf16_b16_offload": ("gpt", 1, "bf16-mixed", 16, False, 1.0, False),
    "resnet_s1_fp32_b32": ("resnet", 1, "32-true", 32, False, 0.0, False),
    "resnet_s2_fp32_b32": ("resnet", 2, "32-true", 32, False, 0.0, False),
    "resnet_s3_fp32_b32": ("resnet", 3, "32-true", 32, False, 0.0, False),
    "resnet_s2_bf16_b32": ("resnet", 2, "bf16-mixed", 32, False, 0.0, False),
    "resnet_s3_fp32_b64_ac": ("resnet", 3, "32-true", 64, True, 0.0, False),
    "resnet_s2_fp32_b64_offload0.5": ("resnet", 2, "32-true", 64, False, 0.5, False),
    "resnet_s1_fp32_b64_ac": ("resnet", 1, "32-true", 64, True, 0.0, False),
    "resnet_s3_bf16_b64_offload": ("resnet", 3, "bf16-mixed", 64, False, 1.0, True),
    "adapted_s2_fp32_b8": ("adapted", 2, "32-true", 8, False, 0.0, False),
    "adapted_s3_fp32_b8": ("adapted", 3, "32-true", 8, False, 0.0, False),
    "adapted_s2_bf16_b8": ("adapted", 2, "bf16-mixed", 8, False, 0.0, False),
    "adapted_s3_bf16_b8": ("adapted", 3, "bf16-mixed", 8, False, 0.0, False),
    "gpt_s2_fp32_b8_bf16states": ("gpt", 2, "32-true", 8, False, 0.0, False, "bf16"),
    "gpt_s3_bf16_b8_offload_bf16states": ("gpt", 3, "bf16-mixed", 8, False, 1.0, False, "bf16"),
}


class Adapted(nn.Module):
    """A frozen layer under a trainable low-rank adapter."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(4, width) * 0.01)
        self.b = nn.Parameter(torch.zeros(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


class AdaptedModel(L.LightningModule):
    """Fine-tuning with low-rank adapters: nearly every parameter frozen (stage 3 shards and gathers them all the
    same), and a frozen integer table, which stage 3 keeps whole."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Adapted(512) for _ in range(4)])
        self.head = nn.Linear(512, 1)
        self.order = nn.Parameter(torch.arange(512 * 64).flip(0), requires_grad=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x[:, self.order[:512] % 512]
        for block in self.blocks:
            x = torch.tanh(block(x))
        return F.mse_loss(self.head(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def build(model: str):
    if model == "gpt":
        return GPTLightningModule(**GPT, build_in_configure_model=True)
    if model == "adapted":
        return AdaptedModel()
    return ResNetClassifier(**RESNET)


def data(model: str):
    if model == "gpt":
        return RandomTokenDataset(num_samples=256, block_size=GPT["block_size"], vocab_size=GPT["vocab_size"], seed=1)
    if model == "adapted":
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(256, 512, generator=g), torch.randn(256, 1, generator=g))
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(512, 3, 16, 16, generator=g), torch.randint(0, 10, (512,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def measure(
    model: str,
    stage: int,
    precision: str,
    batch: int,
    ac: bool,
    ratio: float,
    params_off: bool,
    state_dtype: str = "fp32",
) -> list[int]:
    L.seed_everything(0)
    probe = PeakMemory(first=1, count=1)
    checkpointing = (Block if model == "gpt" else BasicBlock) if ac else None
    offload = True if ratio >= 1 else ratio or False
    strategy = ZeroStrategy(
        stage=stage,
        activation_checkpointing=checkpointing,
        offload_optimizer=offload,
        offload_params=params_off,
        optimizer_state_dtype=state_dtype,
    )
    t = trainer(strategy, max_steps=3, callbacks=[probe], limit_val_batches=0, precision=precision)
    t.fit(build(model), models.loader(data(model), batch))
    return probe.peaks


def predicted(
    model: str,
    stage: int,
    precision: str,
    batch: int,
    ac: bool,
    ratio: float,
    params_off: bool,
    state_dtype: str = "fp32",
):
    sample = next(iter(models.loader(data(model), batch)))
    checkpointing = (Block if model == "gpt" else BasicBlock) if ac else None
    trace = trace_step(lambda: build(model), sample, precision=precision, activation_checkpointing=checkpointing)
    configuration = Configuration(stage, ratio, params_off, optimizer_state_dtype=state_dtype)
    return predict(trace, configuration, WORLD, backend="gloo")


def calibration(directory: Path) -> dict:
    only = os.environ.get("LZ_CASES")
    out = {}
    for name, case in CASES.items():
        if only and name not in only.split(","):
            continue
        peaks = measure(*case)
        if RANK == 0:
            prediction = predicted(*case)
            out[name] = {
                "peaks": peaks,
                "measured": max(peaks),
                "predicted": prediction.device_bytes,
                "host": prediction.host_bytes,
                "error": prediction.device_bytes / max(peaks) - 1,
                "breakdown": prediction.breakdown,
            }
    return out


#: Budgets for the demo GPT (per-device batch 16) that make the planner pick three different configurations, none
#: offloading (on a CPU run host and device are one memory, so only then is the measured peak all device memory).
BUDGETS_MIB = (48, 20, 13)


def budget(directory: Path) -> dict:
    """For each budget: the planner's pick for the demo GPT, then that pick trained for real and its peak measured
    (on a CPU run device and host are one memory: the offloaded part counts against the budget as well)."""
    from lightning_zero.planning import Planner

    sample = next(iter(models.loader(data("gpt"), 16)))
    planner = Planner(lambda: build("gpt"), sample, world_size=WORLD, checkpointing=Block, backend="gloo")
    out = {}
    for mib in BUDGETS_MIB:
        pick = planner.plan(mib * 2**20).pick
        c = pick.configuration
        L.seed_everything(0)
        probe = PeakMemory()
        strategy = ZeroStrategy(**c.strategy_args(), activation_checkpointing=Block if pick.checkpointing else None)
        t = trainer(
            strategy, max_steps=3, callbacks=[probe], limit_val_batches=0, accumulate_grad_batches=pick.accumulate
        )
        t.fit(build("gpt"), models.loader(data("gpt"), pick.micro_batch))
        out[str(mib)] = {
            "configuration": c.name,
            "checkpointing": pick.checkpointing,
            "micro_batch": pick.micro_batch,
            "accumulate": pick.accumulate,
            "predicted": pick.prediction.device_bytes,
            "host": pick.prediction.host_bytes,
            "measured": max(probe.peaks),
            "budget": mib * 2**20,
        }
    return out


GROUPS = {"calibration": calibration, "budget": budget}

if __name__ == "__main__":
    run_cases_with_directory(GROUPS, sys.argv[1:])
