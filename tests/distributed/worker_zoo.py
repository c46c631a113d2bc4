"""Rank program for ``test_model_zoos.py``: each architecture of ``hf_zoo.py`` (group ``hf``) or
``nn_zoo.py`` (group ``nn``) through Trainer at stages 1-3 and under Lightning ``ddp`` (3 optimizer steps, 2
accumulated micro-batches, clipping), fp32, at stage 3 with activation checkpointing on its block class, and (``nn``)
at stage 2 with the optimizer offloaded. A failing architecture is reported with its traceback, not raised, so one
crash does not hide the others.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_zoo GROUP``); rank 0 reports.
"""

from __future__ import annotations

import sys
import traceback
from types import ModuleType

import lightning as L

from lightning_zero import ZeroStrategy
from tests.distributed import hf_zoo, models, nn_zoo
from tests.distributed.worker_core import RANK, max_diff, trainer
from tests.launch import run_cases

SYSTEMS = {"hf": ("zero1", "zero2", "zero3", "zero3_checkpointed"),
           "nn": ("zero1", "zero2", "zero3", "zero3_checkpointed", "zero2_offload")}


def fit(zoo: ModuleType, kind: str, system: str) -> dict:
    L.seed_everything(5)
    module = hf_zoo.ZooModule(kind) if zoo is hf_zoo else nn_zoo.NnZooModule(kind)
    if system == "ddp":  # experts some ranks' tokens skip, and Switch's dropped tokens, leave parameters unused
        strategy = "ddp_find_unused_parameters_true"
    else:
        checkpointed = None
        if system.endswith("checkpointed"):
            checkpointed = {hf_zoo.block_class(module) if zoo is hf_zoo else nn_zoo.CHECKPOINTED[kind]}
        strategy = ZeroStrategy(stage=int(system[4]), activation_checkpointing=checkpointed,
                                offload_optimizer=system.endswith("offload"))
    t = trainer(strategy, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=1.0)
    t.fit(module, models.loader(zoo.tokens(), 2))
    return module.state_dict() if system == "ddp" else t.strategy.full_state_dict()


def architecture(zoo: ModuleType, group: str, kind: str) -> dict:
    out: dict = {}
    try:
        reference = fit(zoo, kind, "ddp")
        for system in SYSTEMS[group]:
            final = fit(zoo, kind, system)
            out[system] = max_diff(final, reference) if RANK == 0 else None
    except Exception:  # the behaviour under test: which architecture fails, and how
        out["error"] = traceback.format_exc()
    return out


CASES = {
    "hf": lambda: {kind: architecture(hf_zoo, "hf", kind) for kind in hf_zoo.KINDS},
    "nn": lambda: {kind: architecture(nn_zoo, "nn", kind) for kind in nn_zoo.KINDS},
}

if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
