"""A console loss report for the examples: a short trace from rank 0, a ``loss A -> B`` summary, and on a terminal a
progress bar counted in optimizer steps."""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

#: ``step 37/150 |███▌      | 25% [00:14<00:43, 2.61step/s, epoch=0, train_loss=2.31, tok/s=4730]``
BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| {percentage:3.0f}% [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class LossReport(L.Callback):
    """Prints rank 0's loss every ``every`` steps and, at the end, the first step's loss against the mean of
    the last ``tail`` steps (smoothing out batch noise) as ``loss A -> B``.

    The examples' tests read that line to check that the loss fell.

    ``progress_bar``: also draw a bar of optimizer steps (``step 37/150``, not Lightning's ``Epoch 0/-2`` of a
    ``max_steps`` run) with the progress-bar metrics (the ZeroMonitor's ``tok/s``, ``state_MiB``, ``comm_MiB``) and
    none of the logger's ``v_num``. ``None`` (default): only when rank 0's output is a terminal, so CI logs and
    ``| tee`` files get the trace lines alone, and only when the Trainer draws no bar of its own
    (``enable_progress_bar=True`` with no other progress bar gives Lightning's). The bar belongs to this callback,
    not to Lightning's ``enable_progress_bar``, because a progress-bar callback in a shipped config would make
    ``trainer.enable_progress_bar=false`` an error (Lightning refuses a progress-bar callback it is told to disable).
    """

    def __init__(self, every: int = 10, tail: int = 10, progress_bar: bool | None = None) -> None:
        self.every = every
        self.tail = tail
        self.progress_bar = progress_bar
        self.losses: list[float] = []
        self.t0 = 0.0
        self._bar: Tqdm | None = None

    def __getstate__(self) -> dict:
        return {**vars(self), "_bar": None}  # a live bar cannot be pickled (spawn start method)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Read here, not at startup: Lightning's launcher sets threads per rank when it starts the ranks.
        if trainer.is_global_zero:
            print(f"torch threads per rank: {torch.get_num_threads()}", flush=True)
            if self._wants_bar(trainer):
                self._bar = step_bar(trainer)
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        step = trainer.global_step
        if not trainer.is_global_zero:
            return
        if step % self.every == 0 or step == 1:
            self._print(f"step {step:4d}  loss {self.losses[-1]:.3f}  ({time.perf_counter() - self.t0:.1f}s)")
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(bar_metrics(trainer), refresh=True)
            if step == self._bar.total:
                self._close_bar()  # its line ends before Lightning's "`Trainer.fit` stopped" and the validation

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_bar()
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

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close_bar()

    def _wants_bar(self, trainer: L.Trainer) -> bool:
        if self.progress_bar is not None:
            return self.progress_bar
        return trainer.progress_bar_callback is None and sys.stdout.isatty()

    def _print(self, line: str) -> None:
        """A trace line above the bar (tqdm clears and redraws it), or a plain line when there is none."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def step_bar(trainer: L.Trainer) -> Tqdm:
    """A bar of optimizer steps out of the run's total: ``max_steps``, or what ``max_epochs`` amounts to."""
    total = trainer.estimated_stepping_batches
    return Tqdm(
        total=None if total == float("inf") else int(total),
        initial=trainer.global_step,  # a resumed run starts part-way
        desc="step",
        unit="step",
        file=sys.stdout,
        dynamic_ncols=True,
        smoothing=0,
        leave=True,
        bar_format=BAR_FORMAT,
    )


def bar_metrics(trainer: L.Trainer) -> dict[str, Any]:
    """The epoch and what the module and callbacks logged with ``prog_bar=True``, without the logger's ``v_num``."""
    metrics = {name: short_number(value) for name, value in trainer.progress_bar_metrics.items()}
    return {"epoch": trainer.current_epoch, **metrics}


def short_number(value: Any) -> str:
    """4 significant digits, and large figures whole (``4730``, not Lightning's ``4.73e+3``)."""
    value = float(value)
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
