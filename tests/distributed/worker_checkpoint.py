"""Rank program for checkpoint tests: exact resume, resharding, atomicity, corruption (pattern: worker_core)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy, checkpoint_io
from tests.distributed import models
from tests.distributed.worker_core import RANK, WORLD, max_diff, trainer
from tests.launch import write_report

COMMON = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
DATA = models.IndexedData(n=48)  # 3 optimizer steps per epoch on 2 ranks: 48 / 2 ranks / 4 per batch / 2 micro


def final_state(t: L.Trainer) -> tuple[dict, dict]:
    return t.strategy.full_state_dict(), checkpoint_io.full_optimizer_state(t.optimizers[0], t.lightning_module, t.strategy.engine)


def optim_diff(a: dict, b: dict) -> float:
    return max(
        (a["state"][i][k].double() - b["state"][i][k].double()).abs().max().item()
        for i in b["state"]
        for k in b["state"][i]
    )


def straight(stage: int) -> tuple[dict, dict]:
    L.seed_everything(7)
    t = trainer(ZeroStrategy(stage=stage), max_epochs=2, **COMMON)
    t.fit(models.Regression(), models.loader(DATA, 4))
    return final_state(t)


def interrupted(save_stage: int, resume_stage: int, directory: Path, state_dict_type: str = "sharded") -> tuple[dict, dict, int]:
    """One epoch at ``save_stage`` with ModelCheckpoint, then a new Trainer resumes for the second epoch."""
    L.seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    strategy = ZeroStrategy(stage=save_stage, state_dict_type=state_dict_type)
    first = trainer(strategy, max_epochs=1, enable_checkpointing=True, callbacks=[ckpt], **COMMON)
    first.fit(models.Regression(), models.loader(DATA, 4))
    path = first.strategy.broadcast(ckpt.best_model_path or str(directory / "epoch=0.ckpt"))
    L.seed_everything(7)  # same script, same seed (Lightning seeds the DistributedSampler with it)
    torch.manual_seed(123)  # ... but a different RNG state: the checkpoint's must be restored
    second = trainer(ZeroStrategy(stage=resume_stage), max_epochs=2, **COMMON)
    second.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=path)
    return (*final_state(second), second.global_step)


def exact_resume(directory: Path) -> dict:
    out = {}
    for save_stage, resume_stage in ((1, 1), (2, 2), (3, 3), (2, 3), (2, 1), (3, 2)):
        ref_params, ref_optim = straight(resume_stage)
        params, optim, steps = interrupted(save_stage, resume_stage, directory / f"{save_stage}-{resume_stage}")
        if RANK == 0:
            out[f"{save_stage}->{resume_stage}"] = {
                "steps": steps,
                "param_diff": max_diff(params, ref_params),
                "optim_diff": optim_diff(optim, ref_optim),
            }
    return out


CASES = {"exact_resume": exact_resume}

if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(os.environ.get("LZ_SHARED_DIR", tmp))
        report = {group: CASES[group](directory) for group in sys.argv[1:]}
    if RANK == 0:
        write_report(report)
