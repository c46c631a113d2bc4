"""Rank program for a checkpoint written under one torch release and resumed under another (``make test-torch``:
the oldest admitted torch writes, the newest resumes, and the other way; ``test_torch_versions.py``: one release
both ways). ``write`` saves each stage's sharded checkpoint after the first epoch into ``$LZ_SHARED_DIR``, with the
writer's uninterrupted two-epoch result beside it; ``resume`` runs the second epoch from it under this torch and
compares with this torch's own uninterrupted run (the resume is exact if they agree) and with the writer's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from tests.distributed import models
from tests.distributed.worker_checkpoint import COMMON, DATA, final_state, optim_diff, optim_scale, straight
from tests.distributed.worker_core import RANK, max_diff, trainer
from tests.launch import run_cases_with_directory

STAGES = (2, 3)


def write(directory: Path) -> dict:
    out = {}
    for stage in STAGES:
        where = directory / f"stage{stage}"
        params, _ = straight(stage)
        L.seed_everything(7)
        ckpt = ModelCheckpoint(dirpath=where, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        first = trainer(ZeroStrategy(stage=stage), max_epochs=1, enable_checkpointing=True, callbacks=[ckpt], **COMMON)
        first.fit(models.Regression(), models.loader(DATA, 4))
        if RANK == 0:
            torch.save(params, where / "straight.pt")
            (where / "written_by.json").write_text(json.dumps({"torch": torch.__version__}))
            out[f"stage{stage}"] = {"torch": torch.__version__, "steps": first.global_step}
        first.strategy.barrier()
    return out


def resume(directory: Path) -> dict:
    out = {}
    for stage in STAGES:
        where = directory / f"stage{stage}"
        writer = json.loads((where / "written_by.json").read_text())["torch"]
        own_params, own_optim = straight(stage)
        L.seed_everything(7)
        torch.manual_seed(123)  # a different RNG state: the checkpoint's must be restored
        second = trainer(ZeroStrategy(stage=stage), max_epochs=2, **COMMON)
        try:
            second.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=str(where / "epoch=0.ckpt"))
        except Exception as error:  # noqa: BLE001 - what the user sees is the result
            out[f"stage{stage}"] = {"written_by": writer, "refused": f"{type(error).__name__}: {error}"}
            continue
        params, optim = final_state(second)
        if RANK == 0:
            writers = torch.load(where / "straight.pt", weights_only=True)
            out[f"stage{stage}"] = {
                "written_by": writer,
                "resumed_by": torch.__version__,
                "steps": second.global_step,
                "param_diff": max_diff(params, own_params),
                "optim_diff": optim_diff(optim, own_optim),
                "param_diff_to_writer": max_diff(params, writers),
                **optim_scale(own_optim),
            }
    return out


CASES = {"write": write, "resume": resume}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
