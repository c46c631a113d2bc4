"""Rank program for ``stage="auto"`` (``strategy/auto_choice.py``): the demo GPT and a tiny Hugging Face Llama on 2
ranks under budgets set with ``device_memory`` (ample, tight, tighter, one nothing fits), each choice trained with its
peak measured; the choice against the same configuration written by hand, its batches split inside the step; a
resumed fit reusing the choice its checkpoint recorded; a batch the strategy cannot split, manual optimization, and the
check after the first steps meeting memory the trace cannot see.

Groups: ``budgets`` (the demo GPT), ``llama`` (the tiny Llama), ``exact``, ``resume``, ``edges``.

The models have small layers (a few MB) and ``unit_size_mb=0`` is given: stage 3 then gathers one layer at a time.
At the default 100 MB the whole model is one unit, gathered whole, and stage 3 saves nothing a model this small
could show (the planner knows: it weighs stage 3 with the units the run will use).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.demo.data import RandomTokenDataset
from lightning_zero.demo.gpt import GPTLightningModule
from tests.distributed import models
from tests.distributed.worker_core import RANK, max_diff, trainer
from tests.launch import run_cases_with_directory

#: The demo GPT at 6 layers of 192 (2.7M parameters) over 256 positions, 2 sequences per rank.
GPT = dict(vocab_size=34, block_size=256, n_layer=6, n_head=4, n_embd=192)
GPT_BATCH = 2
#: Budgets (MiB per device): ample (stage 1), tight (stage 3 with checkpointing), tighter (offload), nothing fits.
BUDGETS_MIB = {"ample": 80, "tight": 40, "tighter": 25, "nothing": 15}
#: The tiny Llama (6 layers of 192, grouped-query attention, 256 positions) and its budgets.
LLAMA_BUDGETS_MIB = {"ample": 96, "tight": 38, "tighter": 30, "nothing": 16}
LLAMA_LENGTH = 256


def gpt(**overrides) -> GPTLightningModule:
    return GPTLightningModule(**{**GPT, **overrides}, build_in_configure_model=True)


def gpt_data(block_size: int = GPT["block_size"], vocab: int = GPT["vocab_size"]) -> torch.utils.data.Dataset:
    return RandomTokenDataset(num_samples=64, block_size=block_size, vocab_size=vocab, seed=1)


class TinyLlama(L.LightningModule):
    """A Llama-style causal LM from a tiny config, built in ``configure_model``; batches are dicts."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=256,
            hidden_size=192,
            intermediate_size=512,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=LLAMA_LENGTH,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TokenDicts(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.rows = torch.randint(0, 256, (64, LLAMA_LENGTH), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def fit_auto(build, data, batch: int, steps: int = 3, trainer_kwargs=None, **settings) -> tuple[L.Trainer, float]:
    """Fit under ``stage="auto"``; also the seconds from ``fit`` to the first training batch."""
    L.seed_everything(0)
    started = {}

    class FirstBatch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            started.setdefault("at", time.perf_counter())

    strategy = ZeroStrategy(stage="auto", **settings)
    t = trainer(strategy, max_steps=steps, limit_val_batches=0, callbacks=[FirstBatch()], **(trainer_kwargs or {}))
    begin = time.perf_counter()
    t.fit(build(), models.loader(data(), batch))
    return t, started["at"] - begin


def report(t: L.Trainer, seconds: float) -> dict:
    choice = t.strategy.auto_choice
    return {
        "stage": t.strategy.stage,
        "settings": choice.settings,
        "micro_batch": choice.micro_batch,
        "splits": choice.splits,
        "accumulate": t.accumulate_grad_batches,
        "predicted_device": choice.predicted_device,
        "predicted_host": choice.predicted_host,
        "measured": t.strategy.auto_measured_peak,
        "checkpointing": t.strategy.zero_config.activation_checkpointing is not None,
        "offload_optimizer": t.strategy.zero_config.offload_optimizer,
        "table": choice.table,
        "fit_to_first_step_s": seconds,
    }


def ladder(build, data, batch: int, budgets: dict) -> dict:
    out = {}
    for name, mib in budgets.items():
        try:
            t, seconds = fit_auto(build, data, batch, steps=2, device_memory=f"{mib}MiB", unit_size_mb=0)
        except Exception as err:  # noqa: BLE001 - the refusal is what this budget shows
            out[name] = {"error": type(err).__name__, "message": str(err)}
            continue
        out[name] = report(t, seconds) | {"budget": mib * 2**20}
    return out


def budgets(directory: Path) -> dict:
    return ladder(gpt, gpt_data, GPT_BATCH, BUDGETS_MIB)


def llama(directory: Path) -> dict:
    return ladder(TinyLlama, TokenDicts, GPT_BATCH, LLAMA_BUDGETS_MIB)


#: The demo GPT at 4 x 128 over 64 positions, 16 sequences per rank: at 22 MiB the planner splits each batch (stage 1,
#: micro-batch 2), with accumulation, clipping, two parameter groups, warmup and dropout around it.
SPLIT = dict(vocab_size=34, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.1, warmup_steps=2)
SPLIT_LOOP = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
#: name -> (the GPT's settings, sequences per rank, MiB per device, the loop's settings, other strategy settings)
EXACT = {
    "split": (SPLIT, 16, 22, SPLIT_LOOP, {}),
    # 12 a rank, parts of 4 and 3 accumulated: neither a power of two (each part's loss divided once, as by hand), and
    # each epoch's last batch of 8 in two parts.
    "split_by_three": (SPLIT, 12, 26, {"accumulate_grad_batches": 3, "gradient_clip_val": 0.5}, {}),
    "stage3_checkpointed": ({**GPT, "dropout": 0.1}, GPT_BATCH, 40, {"gradient_clip_val": 0.5}, {"unit_size_mb": 0}),
    "offloaded": (GPT, GPT_BATCH, 25, {"gradient_clip_val": 0.5}, {"unit_size_mb": 0}),
}


def exact(directory: Path) -> dict:
    """``stage="auto"`` against the configuration it chose, written by hand (batches of the micro-batch, the
    accumulation multiplied by the splits): the same parameters after 3 optimizer steps."""
    from lightning_zero.demo.gpt import Block

    out = {}
    only = os.environ.get("LZ_CASES")
    for name, (shape, batch, mib, loop, settings) in EXACT.items():
        if only and name not in only.split(","):
            continue
        data = lambda: gpt_data(shape["block_size"])  # noqa: E731
        t, _ = fit_auto(
            lambda: gpt(**shape), data, batch, steps=3, trainer_kwargs=loop, device_memory=f"{mib}MiB", **settings
        )
        choice = t.strategy.auto_choice
        automatic = t.strategy.full_state_dict()
        chosen = dict(choice.settings)
        chosen["activation_checkpointing"] = Block if chosen["activation_checkpointing"] else None
        L.seed_everything(0)
        by_hand = trainer(
            ZeroStrategy(**chosen, **settings),
            max_steps=3,
            limit_val_batches=0,
            **{**loop, "accumulate_grad_batches": loop.get("accumulate_grad_batches", 1) * choice.splits},
        )
        by_hand.fit(gpt(**shape), models.loader(data(), choice.micro_batch))
        written = by_hand.strategy.full_state_dict()
        if RANK == 0:
            out[name] = {
                "settings": choice.settings,
                "micro_batch": choice.micro_batch,
                "splits": choice.splits,
                "diff": max_diff(automatic, written),
                "moved": max_diff(automatic, gpt_state(shape)),
            }
    return out


def gpt_state(overrides: dict) -> dict:
    L.seed_everything(0)
    module = gpt(**overrides)
    module.configure_model()
    return {f"model.{k}": v for k, v in module.model.state_dict().items()}


def resume(directory: Path) -> dict:
    """A fit under a tight budget saves a checkpoint; a fit resumed from it under an ample one reuses its choice, and so
    does a ``validate`` of it."""
    t, _ = fit_auto(gpt, gpt_data, GPT_BATCH, steps=2, device_memory="40MiB", unit_size_mb=0)
    path = directory / "auto.ckpt"
    t.save_checkpoint(path)
    first = t.strategy.auto_choice
    L.seed_everything(0)
    again = trainer(ZeroStrategy(stage="auto", device_memory="80MiB", unit_size_mb=0), max_steps=3, limit_val_batches=0)
    again.fit(gpt(), models.loader(gpt_data(), GPT_BATCH), ckpt_path=str(path))
    evaluating = trainer(ZeroStrategy(stage="auto", device_memory="80MiB", unit_size_mb=0), limit_val_batches=2)
    evaluating.validate(gpt(), models.loader(gpt_data(), GPT_BATCH), ckpt_path=str(path))
    return {
        "validated_stage": evaluating.strategy.stage,
        "first": first.settings,
        "resumed": again.strategy.auto_choice.settings,
        "resumed_stage": again.strategy.stage,
        "resumed_step": again.global_step,
    }


class Manual(GPTLightningModule):
    def __init__(self) -> None:
        super().__init__(**SPLIT, build_in_configure_model=True)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self._loss(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


class Named(torch.utils.data.Dataset):
    """Samples that carry a string: batches hold a list of names, which cannot be split as tensors are."""

    def __init__(self) -> None:
        self.tokens = gpt_data(SPLIT["block_size"])

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple:
        x, y = self.tokens[i]
        return x, y, f"sample-{i}"


class NamedBatches(GPTLightningModule):
    def __init__(self) -> None:
        super().__init__(**SPLIT, build_in_configure_model=True)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return self._loss((x, y))


class Hoarding(GPTLightningModule):
    """Allocates 16 MiB in a hook at each batch (a cache outside ``training_step``, which the planner traces)."""

    def __init__(self) -> None:
        super().__init__(**GPT, build_in_configure_model=True)

    def on_train_batch_start(self, batch, batch_idx):
        self.hoard = torch.zeros(4 * 2**20)


def edges(directory: Path) -> dict:
    """A batch holding strings: the micro-batch is the batch, and the table says why. Manual optimization: refused on
    every rank before training, naming the way out. Memory the trace cannot see: the check after the first steps warns."""
    t, _ = fit_auto(NamedBatches, Named, 16, steps=2, device_memory="30MiB")
    choice = t.strategy.auto_choice
    out = {"strings": {"micro_batch": choice.micro_batch, "splits": choice.splits, "table": choice.table}}
    try:
        fit_auto(Manual, lambda: gpt_data(SPLIT["block_size"]), 16, steps=2, device_memory="22MiB")
    except Exception as err:  # noqa: BLE001 - the refusal is what this case shows
        out["manual"] = {"error": type(err).__name__, "message": str(err)}
    # A module that holds 16 MiB the traced step never sees: the check after the first steps warns.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t, _ = fit_auto(Hoarding, gpt_data, GPT_BATCH, steps=2, device_memory="80MiB")
    out["unforeseen"] = {
        "warnings": [str(w.message) for w in caught if "zero_auto" in str(w.message)],
        "measured": t.strategy.auto_measured_peak,
        "predicted": t.strategy.auto_choice.predicted_device,
    }
    return out


GROUPS = {"budgets": budgets, "llama": llama, "exact": exact, "resume": resume, "edges": edges}

if __name__ == "__main__":
    run_cases_with_directory(GROUPS, sys.argv[1:])
