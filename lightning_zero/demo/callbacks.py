"""A console loss report for the examples: a short trace from rank 0 and a ``loss A -> B`` summary."""

from __future__ import annotations

import time

import lightning as L
import torch


class LossReport(L.Callback):
    """Prints rank 0's loss every ``every`` steps and, at the end, the first step's loss against the mean of
    the last ``tail`` steps (smoothing out batch noise) as ``loss A -> B``.

    The examples' tests read that line to check that the loss fell.
    """

    def __init__(self, every: int = 10, tail: int = 10) -> None:
        self.every = every
        self.tail = tail
        self.losses: list[float] = []
        self.t0 = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Read here, not at startup: Lightning's launcher sets threads per rank when it starts the ranks.
        if trainer.is_global_zero:
            print(f"torch threads per rank: {torch.get_num_threads()}", flush=True)
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        step = trainer.global_step
        if trainer.is_global_zero and (step % self.every == 0 or step == 1):
            print(f"step {step:4d}  loss {self.losses[-1]:.3f}  ({time.perf_counter() - self.t0:.1f}s)", flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self.losses:
            return
        end = sum(self.losses[-self.tail :]) / len(self.losses[-self.tail :])
        extra = "".join(
            f", {name} {float(trainer.callback_metrics[name]):.3f}"
            for name in ("val_loss", "val_acc")
            if name in trainer.callback_metrics
        )
        print(
            f"loss {self.losses[0]:.2f} -> {end:.2f} "
            f"(first step -> mean of last {min(self.tail, len(self.losses))}{extra}; "
            f"{len(self.losses)} steps in {time.perf_counter() - self.t0:.1f}s)",
            flush=True,
        )
