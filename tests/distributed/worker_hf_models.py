"""Rank program for ``test_hf_models.py``: Hugging Face GPT-2, BERT and Llama through Trainer at every stage,
in fp32 (against plain single-process PyTorch) and bf16-mixed (against a single-process emulation of the same
mixed arithmetic), with and without activation checkpointing on the library's block classes.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_hf_models GROUP``); rank 0 reports.
"""

from __future__ import annotations

import copy
import os
import sys

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.demo.data import RandomTokenDataset
from tests.distributed import models
from tests.distributed.hf_models import LENGTH, MASK_ID, HFLightningModule, block_class, model_class, tiny_config
from tests.distributed.mixed_reference import fp32_run, mixed_reference
from tests.distributed.worker_core import max_diff, trainer
from tests.launch import run_cases

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
BATCH, CLIP, STEPS = 2, 1.0, 3
KINDS = ("gpt2", "bert", "llama")


def data() -> RandomTokenDataset:
    return RandomTokenDataset(num_samples=32, block_size=LENGTH, vocab_size=MASK_ID, seed=7)


def run(kind: str, stage: int, precision: str, checkpointing: bool, module_cls=HFLightningModule, **strategy_kwargs) -> dict:
    """``STEPS`` optimizer steps with clipping, 2 param groups and a warmup schedule; fp32 runs accumulate 2
    micro-batches per step. ``module_cls``: the module (another optimizer); ``strategy_kwargs``: more ZeroStrategy
    settings (hybrid sharding)."""
    L.seed_everything(21)
    module = module_cls(kind)
    initial = copy.deepcopy(module.state_dict())
    accumulate = 2 if precision == "32-true" else 1
    checkpointed = block_class(kind) if checkpointing else None
    strategy = ZeroStrategy(stage=stage, activation_checkpointing=checkpointed, **strategy_kwargs)
    t = trainer(strategy, max_steps=STEPS, gradient_clip_val=CLIP, accumulate_grad_batches=accumulate, precision=precision)
    dataset = data()
    t.fit(module, models.loader(dataset, BATCH))
    final = t.strategy.full_state_dict()
    out = {"steps": t.global_step}
    if RANK == 0:
        build = lambda: module_cls(kind)  # noqa: E731
        kwargs = dict(world=WORLD, batch=BATCH, steps=STEPS, clip=CLIP)
        if precision == "32-true":
            _, reference = fp32_run(initial, build, dataset, **kwargs, accumulate=accumulate)
        else:
            policy = t.strategy.precision_plugin.policy()
            groups = WORLD // t.strategy.engine.world_size
            reference = mixed_reference(
                initial, build, dataset, **kwargs, policy=policy, hold_sum_in_param_dtype=stage != 3, shard_groups=groups
            )["params"]
        out["diff"] = max_diff(final, reference)
        out["change"] = max_diff(reference, initial)
        if kind == "gpt2":
            out["tied"] = bool((final["model.lm_head.weight"] == final["model.transformer.wte.weight"]).all())
    return out


class BuiltInConfigureModel(HFLightningModule):
    """Lightning's pattern for large models: the network is built in ``configure_model`` (on the meta device
    under stage 3) and materialised sharded with the library's own initialisation."""

    def __init__(self, kind: str) -> None:
        L.LightningModule.__init__(self)
        self.kind = kind
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = model_class(self.kind)(tiny_config(self.kind))


class InitialState(L.Callback):
    """The materialised model before any step, against an eager CPU build (rank 0)."""

    def __init__(self) -> None:
        self.out: dict = {}

    def on_train_start(self, trainer, pl_module):
        full = trainer.strategy.full_state_dict()
        buffers = {name: b.detach().cpu().clone() for name, b in pl_module.named_buffers()}
        if RANK != 0:
            return
        eager = model_class(pl_module.kind)(tiny_config(pl_module.kind))
        exact, spread = [], {}
        for name, value in eager.state_dict().items():
            got = full[f"model.{name}"]
            if value.is_floating_point() and value.numel() > 1 and float(value.std()) > 0:
                spread[name] = (float(got.std()), float(value.std()), abs(float(got.mean())), got.numel())
            elif not torch.equal(got.to(value.dtype), value):
                exact.append(name)
        for name, value in eager.named_buffers():
            if not torch.equal(buffers[f"model.{name}"].to(value.dtype), value):
                exact.append(name)
        self.out = {"not_equal": exact, "spread": spread}
        if pl_module.kind == "gpt2":
            self.out["tied"] = pl_module.model.lm_head.weight is pl_module.model.transformer.wte.weight


def meta_init(kind: str) -> dict:
    L.seed_everything(21)
    probe = InitialState()
    t = trainer(ZeroStrategy(stage=3), max_steps=2, callbacks=[probe], precision="bf16-mixed")
    t.fit(BuiltInConfigureModel(kind), models.loader(data(), BATCH))
    return {**probe.out, "steps": t.global_step}


def cases(precisions, checkpointing) -> dict:
    return {
        f"{kind}/stage{stage}/{precision}/{'ac' if ac else 'plain'}": run(kind, stage, precision, ac)
        for kind in KINDS
        for stage in (1, 2, 3)
        for precision in precisions
        for ac in checkpointing
    }


CASES = {
    # `make test`: every model at every stage, fp32 with activation checkpointing, bf16-mixed without.
    "default": lambda: {
        **cases(["32-true"], [True]),
        **cases(["bf16-mixed"], [False]),
        **{f"{kind}/meta_init": meta_init(kind) for kind in KINDS},
    },
    # `make test-all`: the rest of the matrix.
    "full": lambda: {**cases(["32-true"], [False]), **cases(["bf16-mixed"], [True])},
}


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
