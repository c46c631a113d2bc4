"""Rank program for the auto-resume tests, run under ``torchrun --max-restarts`` (tests/integration/torchrun.py).

``python -m tests.integration.worker_auto_resume DIR CASE [CASE ...]``; a case is
``s{stage}-{precision}-a{accumulate}-{fault}[-{repetition}]`` with precision ``f32`` or ``f16`` (16-mixed, loss
scaling) and fault one of:

* ``step``: rank 1 is SIGKILLed inside a training step, after the epoch-0 end checkpoint (resume at an epoch
  boundary);
* ``epoch``: rank 1 is SIGKILLed inside a training step after a mid-epoch checkpoint (resume mid-epoch);
* ``save``: rank 1 is SIGKILLed while the checkpoint is written, as soon as its shard file is in the checkpoint's
  temporary directory and before the checkpoint is published: the previous checkpoint must be used;
* ``sigterm``: every rank receives SIGTERM (as from a scheduler) inside a step: ZeroStrategy saves
  ``sigterm.ckpt``, the ranks exit, torchrun restarts them, they resume from it;
* ``node`` (two torchrun agents, one rank each): rank 0 is SIGKILLed mid-epoch while rank 1 is alive outside
  any collective (as an NCCL peer that notices nothing): agent 0 restarts its worker as restart 1, agent 1
  restarts its own for the membership change with its restart count still 0. Both agents run on this host, where
  rank 1's watchdog would see at once that rank 0's process is gone and end rank 1 itself (across hosts it sees
  only a silent heartbeat, after ``stale_after``): the faulted attempt runs without the watchdog so that only
  agent 1 restarts rank 1, as the case means; the resumed attempt has it.

``LATE_RESTART`` (seconds): rank 1 of every restarted attempt starts that much later than its peers, as a rank on a
busy or slow node does; with torchrun's shared agent store its peers then find the previous attempt's keys there
first (lightning_zero/strategy/attempt_store.py).

Each case runs the same fit twice: an uninterrupted reference (once per stage/precision/accumulation) and the
run that is faulted once and auto-resumed after torchrun's restart, which then goes on with the next case. The
fault is injected in the first process that runs the case (a marker file says it happened). Every rank appends
one line per training step (epoch, batch, the sample indices, a hash of the RNG state, its pid and restart
count) to ``DIR/<case>/steps-{run}-rank{r}.jsonl``; rank 0 writes the final full parameters to ``DIR/<case>/{run}.pt``.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.checkpoint.write import ShardWriter

RANK = int(os.environ["RANK"])
RESTARTS = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SAMPLES, BATCH, EPOCHS = 40, 2, 2  # 10 batches per epoch and rank
CHECKPOINT_EVERY = 3  # optimizer steps
FAULT_AT = {"step": 13, "epoch": 8, "save": 6, "sigterm": 7, "node": 8}  # batch index counted over both epochs
CHECKPOINT_EVERY_FOR = {"step": 10}  # the epoch's last batch: resume at the epoch boundary
LATE_RESTART = float(os.environ.get("LATE_RESTART", "0"))


class Numbers(Dataset):
    """Sample i is a pure function of i; it also returns i, so each step can record what it saw."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randn(8, generator=g), torch.randn(3, generator=g), i


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 16))

    def forward(self, h):
        return h + self.net(h)


class DropoutModel(L.LightningModule):
    """Dropout (the RNG must be restored exactly), an LR scheduler stepping per optimizer step, and a large
    parameter so that writing a shard takes long enough to be interrupted."""

    def __init__(self, log: Path, fault: str | None, marker: Path) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 3)
        self.bulk = nn.Parameter(torch.zeros(1 << 18))
        self.log_path, self.fault, self.marker = log, fault, marker

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.bulk[:1] * 0.0

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        seen = self.trainer.current_epoch * (SAMPLES // BATCH // 2) + batch_idx
        record = dict(
            epoch=self.trainer.current_epoch,
            batch=batch_idx,
            samples=index.tolist(),
            rng=hashlib.md5(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12],
            pid=os.getpid(),
            restarts=RESTARTS,
        )
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        loss = nn.functional.mse_loss(self(x), y)
        if self.fault is not None and seen == FAULT_AT[self.fault]:
            self._inject(seen)
        return loss

    def _inject(self, seen: int) -> None:
        if self.fault in ("step", "epoch") and RANK == 1 or self.fault == "node" and RANK == 0:
            self.marker.touch()
            print(f"[worker] rank {RANK} SIGKILLs itself in training_step of batch {seen}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "node":  # alive, outside any collective, until its agent restarts it
            print(f"[worker] rank {RANK} sleeps in training_step of batch {seen}", flush=True)
            time.sleep(60)
        elif self.fault == "sigterm":
            self.marker.touch()
            print(f"[worker] rank {RANK} receives SIGTERM in training_step of batch {seen}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.8), "interval": "step"},
        }


class KillDuringSave(Callback):
    """Arms, just before ModelCheckpoint saves at ``step`` (callbacks run before it), a SIGKILL of this process the
    moment this rank's shard file of that checkpoint is written into its temporary directory, before the
    checkpoint is published. Deterministic: a thread polling for the file can miss a fast save on a loaded machine
    and kill a later one."""

    def __init__(self, directory: Path, step: int, marker: Path) -> None:
        self.directory, self.step, self.marker = directory, step, marker

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step and RANK == 1:
            write_data, marker = ShardWriter.write_data, self.marker

            def write_then_die(writer, plan, planner):
                write_data(writer, plan, planner)  # this rank's shard file, complete, in the temporary directory
                marker.touch()
                print(f"[worker] rank 1 SIGKILLs itself while writing {Path(writer.path).name}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            ShardWriter.write_data = write_then_die


def fit(case_dir: Path, run: str, stage: int, precision: str, accumulate: int, fault: str | None) -> None:
    """``fault``: to inject in this run, unless an earlier process of the job already did (its marker exists)."""
    L.seed_everything(11)
    marker = case_dir / "fault-injected"
    fault = fault if fault is not None and not marker.exists() else None
    model = DropoutModel(case_dir / f"steps-{run}-rank{RANK}.jsonl", fault, marker)
    callbacks = []
    if run == "run":
        every = CHECKPOINT_EVERY_FOR.get(case_dir.name.split("-")[3], CHECKPOINT_EVERY) // accumulate
        callbacks.append(
            ModelCheckpoint(
                dirpath=case_dir / "checkpoints", filename="{epoch}-{step}", every_n_train_steps=every, save_top_k=-1
            )
        )
        if fault == "save":
            callbacks.insert(0, KillDuringSave(case_dir / "checkpoints", FAULT_AT["save"] // accumulate, marker))
    plugins = [ZeroPrecision("16-mixed", initial_scale=2.0**10, growth_interval=2)] if precision == "f16" else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
        strategy=ZeroStrategy(stage=stage, watchdog=fault != "node"),
        max_epochs=EPOCHS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0,
        plugins=plugins,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(Numbers(), batch_size=BATCH, shuffle=True)
    trainer.fit(model, loader)
    state = trainer.strategy.full_state_dict()  # collective
    if RANK == 0:
        torch.save(
            {"params": state, "global_step": trainer.global_step, "scale": trainer.precision_plugin.loss_scale},
            case_dir / f"{run}.pt",
        )


def main(directory: Path, cases: list[str]) -> None:
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the torchrun helper asks for stacks on a hang
    print(f"[worker] rank {RANK} pid {os.getpid()} starts (TORCHELASTIC_RESTART_COUNT={RESTARTS})", flush=True)
    if RESTARTS and RANK == 1 and LATE_RESTART:
        print(f"[worker] rank 1 starts {LATE_RESTART:g} s late", flush=True)
        time.sleep(LATE_RESTART)
    for case in cases:
        stage, precision, accumulate, fault, *_ = case.split("-")
        stage, accumulate = int(stage[1:]), int(accumulate[1:])
        case_dir = directory / case
        reference_dir = directory / f"reference-s{stage}-{precision}-a{accumulate}"
        for path in (case_dir, reference_dir):
            path.mkdir(parents=True, exist_ok=True)
        if not (reference_dir / "reference.pt").exists():
            fit(reference_dir, "reference", stage, precision, accumulate, None)
        if not (case_dir / "run.pt").exists():
            fit(case_dir, "run", stage, precision, accumulate, fault)
    print(f"[worker] rank {RANK} done (TORCHELASTIC_RESTART_COUNT={RESTARTS})", flush=True)


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]), sys.argv[2:])
    except SIGTERMException:
        # Lightning's SIGTERMException is a SystemExit without a code (exit status 0); a preempted process exits
        # with 128 + SIGTERM, which is what makes torchrun restart the group here (a scheduler would requeue).
        print(f"[worker] rank {RANK} stopped by SIGTERM", flush=True)
        sys.exit(128 + signal.SIGTERM)
