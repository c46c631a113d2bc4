"""Rank program for ``test_hf_zoo.py``: each architecture of ``hf_zoo.py`` through Trainer at stages 1-3 and
under Lightning ``ddp`` (3 optimizer steps, 2 accumulated micro-batches, clipping), fp32, and at stage 3 with
activation checkpointing on its block class. A failing architecture is reported with its traceback, not raised,
so one crash does not hide the others.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_hf_zoo GROUP``); rank 0 reports.
"""

from __future__ import annotations

import sys
import traceback

import lightning as L

from lightning_zero import ZeroStrategy
from tests.distributed import models
from tests.distributed.hf_zoo import KINDS, ZooModule, block_class, tokens
from tests.distributed.worker_core import RANK, max_diff, trainer
from tests.launch import run_cases

SYSTEMS = ("zero1", "zero2", "zero3", "zero3_checkpointed")


def fit(kind: str, system: str) -> dict:
    L.seed_everything(5)
    module = ZooModule(kind)
    if system == "ddp":  # experts some ranks' tokens skip, and Switch's dropped tokens, leave parameters unused
        strategy = "ddp_find_unused_parameters_true"
    else:
        checkpointed = {block_class(module)} if system.endswith("checkpointed") else None
        strategy = ZeroStrategy(stage=int(system[4]), activation_checkpointing=checkpointed)
    t = trainer(strategy, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=1.0)
    t.fit(module, models.loader(tokens(), 2))
    return module.state_dict() if system == "ddp" else t.strategy.full_state_dict()


def architecture(kind: str) -> dict:
    out: dict = {}
    try:
        reference = fit(kind, "ddp")
        for system in SYSTEMS:
            final = fit(kind, system)
            out[system] = max_diff(final, reference) if RANK == 0 else None
    except Exception:  # the behaviour under test: which architecture fails, and how
        out["error"] = traceback.format_exc()
    return out


CASES = {"zoo": lambda: {kind: architecture(kind) for kind in KINDS}}

if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
