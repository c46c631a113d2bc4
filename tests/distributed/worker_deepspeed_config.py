"""Rank program for a DeepSpeed JSON config driving a real fit (pattern: worker_core): one process, the JSON's
clipping, accumulation, optimizer, scheduler and precision, and a DataLoader that contradicts its micro-batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L

from lightning_zero import ZeroStrategy
from tests.distributed import models
from tests.launch import run_cases_with_directory

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "ds_zero2_offload_fp16.json"


class Probe(L.Callback):
    """What the Trainer ended up with: the settings the JSON gave it."""

    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.out = dict(
            clip=trainer.gradient_clip_val,
            accumulate=trainer.accumulate_grad_batches,
            optimizer=type(opt).__name__,
            betas=list(opt.param_groups[0]["betas"]),
            weight_decay=opt.param_groups[0]["weight_decay"],
            lr=opt.param_groups[0]["lr"],
            scheduler=type(trainer.lr_scheduler_configs[0].scheduler).__name__,
            precision=trainer.strategy.precision_plugin.precision,
            offload=trainer.strategy.zero_config.offload_optimizer,
            steps=trainer.global_step,
        )


class NoOptimizer(models.Regression):
    def configure_optimizers(self):
        return None  # the DeepSpeed config's optimizer and scheduler are used


def fit_from_json(directory: Path, batch: int) -> dict:
    config = json.loads(EXAMPLE.read_text())
    config["train_batch_size"] = 8  # 4 per micro-batch x 2 accumulation x 1 process
    path = directory / "ds.json"
    path.write_text(json.dumps(config))
    probe = Probe()
    t = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ZeroStrategy(config=str(path)),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    try:
        t.fit(NoOptimizer(), models.loader(models.IndexedData(), batch))
    except Exception as err:  # the behaviour under test: the error a contradicting DataLoader gets
        return {"error": f"{type(err).__name__}: {err}"}
    return probe.out


CASES = {
    "fit": lambda directory: {"micro_batch_4": fit_from_json(directory, 4), "batch_2": fit_from_json(directory, 2)},
}


if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
