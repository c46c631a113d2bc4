"""Rank program for ``test_model_zoos.py``: each architecture of ``hf_zoo.py`` (group ``hf``) or
``nn_zoo.py`` (group ``nn``) through Trainer at stages 1-3 and under Lightning ``ddp`` (3 optimizer steps, 2
accumulated micro-batches, clipping), fp32, at stage 3 with activation checkpointing on its block class, and (``nn``)
at stage 2 with the optimizer offloaded; an architecture DDP cannot train (``hf_zoo.WITHOUT_DDP``) against the same
steps in one process. A failing architecture is reported with its traceback, not raised, so one
crash does not hide the others.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_zoo GROUP``); rank 0 reports.
"""

from __future__ import annotations

import sys
import traceback
from types import ModuleType

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_zero import ZeroStrategy
from tests.distributed import hf_zoo, models, nn_zoo
from tests.distributed.worker_core import RANK, WORLD, max_diff, trainer
from tests.launch import run_cases

SYSTEMS = {
    "hf": ("zero1", "zero2", "zero3", "zero3_checkpointed"),
    "nn": ("zero1", "zero2", "zero3", "zero3_checkpointed", "zero2_offload"),
}
#: Runs that must train but compute otherwise than ``ddp`` in fp32: stage 3 under bf16-mixed (its fp32 norm units,
#: their groups and the layers that stay in their blocks' units: ``fsdp2_units.one_dtype_units``).
MIXED = {"hf": ("zero3_bf16",), "nn": ()}


STEPS, ACCUMULATE, BATCH, CLIP = 3, 2, 2, 1.0


def module_of(zoo: ModuleType, kind: str) -> L.LightningModule:
    return hf_zoo.ZooModule(kind) if zoo is hf_zoo else nn_zoo.NnZooModule(kind)


def fit(zoo: ModuleType, kind: str, system: str) -> dict:
    L.seed_everything(5)
    module = module_of(zoo, kind)
    plain = zoo is hf_zoo and kind in hf_zoo.WITHOUT_DDP
    if plain and system == "ddp":
        return plain_reference(module, zoo.tokens())
    if system == "ddp":  # experts some ranks' tokens skip, and Switch's dropped tokens, leave parameters unused
        strategy = "ddp_find_unused_parameters_true"
    else:
        checkpointed = None
        if system.endswith("checkpointed"):
            checkpointed = {hf_zoo.block_class(module) if zoo is hf_zoo else nn_zoo.CHECKPOINTED[kind]}
        strategy = ZeroStrategy(
            stage=int(system[4]), activation_checkpointing=checkpointed, offload_optimizer=system.endswith("offload")
        )
    t = trainer(
        strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        precision="bf16-mixed" if system.endswith("bf16") else "32-true",
    )
    dataset = zoo.tokens()
    if plain:  # Lightning keeps a sampler the user set: rank r takes rows r, r + WORLD, ..., as the reference does
        sampler = DistributedSampler(dataset, WORLD, RANK, shuffle=False)
        t.fit(module, DataLoader(dataset, batch_size=BATCH, sampler=sampler))
    else:
        t.fit(module, models.loader(dataset, BATCH))
    return module.state_dict() if system == "ddp" else t.strategy.full_state_dict()


def plain_reference(module: L.LightningModule, dataset: TensorDataset) -> dict:
    """Trainer's steps in one process, on every rank: each micro-batch's loss the mean of every rank's, scaled by the
    accumulation, the gradient norm clipped, one optimizer step per window; the data loader restarts at its end."""
    optimizer = module.configure_optimizers()
    rows = [dataset.tensors[0][rank::WORLD] for rank in range(WORLD)]
    batches = len(rows[0]) // BATCH
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            index = (step * ACCUMULATE + micro) % batches
            losses = [module.training_step((r[index * BATCH : (index + 1) * BATCH],), index) for r in rows]
            (sum(losses) / (WORLD * ACCUMULATE)).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return module.state_dict()


def architecture(zoo: ModuleType, group: str, kind: str) -> dict:
    out: dict = {}
    try:
        reference = fit(zoo, kind, "ddp")
        for system in SYSTEMS[group]:
            final = fit(zoo, kind, system)
            out[system] = max_diff(final, reference) if RANK == 0 else None
        for system in MIXED[group]:
            final = fit(zoo, kind, system)
            finite = all(bool(v.isfinite().all()) for v in final.values() if v.is_floating_point())
            weights = {n for n, _ in module_of(zoo, kind).named_parameters()}  # buffers (BatchNorm's) move otherwise
            out[system] = (
                {
                    "finite": finite,
                    "from_ddp": max_diff({n: final[n] for n in weights}, {n: reference[n] for n in weights}),
                }
                if RANK == 0
                else None
            )
    except Exception:  # the behaviour under test: which architecture fails, and how
        out["error"] = traceback.format_exc()
    return out


CASES = {
    "hf": lambda: {kind: architecture(hf_zoo, "hf", kind) for kind in hf_zoo.KINDS},
    "nn": lambda: {kind: architecture(nn_zoo, "nn", kind) for kind in nn_zoo.KINDS},
}

if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
