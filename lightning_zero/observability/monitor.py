"""ZeroMonitor: what a ZeRO run costs, per optimizer step, in the Trainer's own logs and progress bar.

The numbers are the ones the benchmarks and the ZeRO formulas speak in, so a run can be checked against
``lightning-zero estimate`` while it trains:

* ``monitor/state_MiB_rank{r}``: model state (parameters, gradients, fp32 masters, optimizer state) each
  rank holds right after backward, from :func:`lightning_zero.planning.accounting.model_state_bytes` (device and host
  together; ``.../device_MiB_rank{r}`` and ``.../host_MiB_rank{r}`` split it when something is offloaded). At a logging
  step it waits for an offloaded host step still running in the worker thread, which creates and writes that state;
* ``monitor/peak_MiB_rank{r}``: peak accelerator memory allocated since the last log, or on CPU the
  process's peak resident memory (``ru_maxrss``, everything the process ever held);
* ``monitor/tokens_per_s`` (or ``samples_per_s`` for non-token inputs): over all ranks, across every step
  since the previous log;
* ``monitor/comm_MiB_per_step``: bytes the busiest rank's collectives moved in the logged step, as counted
  in :mod:`lightning_zero.engine.comm.collectives` (so ZeroStrategy runs only);
* ``monitor/comm_inter_node_MiB``: the part of it that went over process groups spanning several nodes
  (with hybrid sharding, only the gradient shards' all-reduce across nodes);
* ``monitor/loss_scale``: under fp16 with ``ZeroPrecision``, the dynamic loss scale;
* ``monitor/grad_{p}_norm`` (with ``grad_norm_type=p``): the norm of the step's full gradient, as
  :func:`lightning_zero.grad_norm` computes it. The monitor reads the gradients without changing them, so an
  offloaded step still starts during backward (a hook of the user's own between backward and the step keeps it for
  ``optimizer.step()``, see [Note: the host step during backward]).

The per-rank figures are gathered to every rank with one small all-gather at each logging step, made
with `collectives.all_gather_uncounted`, so that the monitor's own traffic is not counted as the model's.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.collectives import comm_stats
from lightning_zero.observability.gradient_norms import grad_norm
from lightning_zero.planning.accounting import model_state_bytes

MIB = 2**20


def count_tokens(batch: Any) -> tuple[int, str]:
    """(count, unit) of the first tensor in ``batch``: its elements if it holds token ids, else its rows."""
    tensor = _first_tensor(batch)
    if tensor is None:
        return 0, "samples"
    if not tensor.is_floating_point() and not tensor.is_complex():
        return tensor.numel(), "tokens"
    return (tensor.shape[0] if tensor.dim() else 1), "samples"


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory since the last call (resets it), or the process's peak RSS."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


class ZeroMonitor(pl.Callback):
    """Logs model-state bytes per rank, peak memory, tokens/s and communication bytes per optimizer step.

    Args:
        log_every_n_steps: how often (in optimizer steps) to measure and log; the Trainer's
            ``log_every_n_steps`` by default (0 switches the monitor off, as it switches Lightning's logging off).
        prog_bar: also show ``tok/s``, ``state_MiB`` (the largest rank's) and ``comm_MiB`` in the progress bar.
        grad_norm_type: also log the norm of the step's gradient (``2``, ``1``, ``"inf"``, any positive p); None:
            not. Under automatic optimization, where each step has one gradient.

    Steps are counted by ``trainer.global_step``, which is one per optimizer step under automatic
    optimization (accumulation included). The first logged step's state has no optimizer state yet if it
    is the very first step: optimizers create theirs at their first ``step()``.
    """

    def __init__(
        self, log_every_n_steps: int | None = None, prog_bar: bool = True, grad_norm_type: float | str | None = None
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 0:
            raise ValueError(f"ZeroMonitor(log_every_n_steps={log_every_n_steps}) must be >= 0 (or None).")
        try:
            norm_type = None if grad_norm_type is None else float(grad_norm_type)
        except (TypeError, ValueError):
            norm_type = math.nan
        if norm_type is not None and not norm_type > 0:
            raise ValueError(
                f"ZeroMonitor(grad_norm_type={grad_norm_type!r}) must be a positive number or 'inf' (or None)."
            )
        self.grad_norm_type = norm_type
        self._grad_norm: float | None = None
        self.log_every_n_steps = log_every_n_steps
        self.prog_bar = prog_bar
        #: the last logged figures, by metric name (also what was sent to the loggers)
        self.last: dict[str, float] = {}
        self._window_open = False
        self._step_before = 0
        self._comm_before = (0, 0)  # (bytes, inter-node bytes) counted when the step began
        self._interval_started: float | None = None  # tokens/s runs over every step since the last log
        self._interval_tokens = 0
        self._unit = "tokens"
        self._state: dict[str, int] | None = None

    def _every(self, trainer: pl.Trainer) -> int:
        if self.log_every_n_steps is not None:
            return self.log_every_n_steps
        return trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning's logger connector, undeclared

    def _logs_at(self, trainer: pl.Trainer, step: int) -> bool:
        every = self._every(trainer)
        return every > 0 and step % every == 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._interval_started is None:
            self._interval_started = _now(trainer.strategy.root_device)
        if not self._window_open:  # the first micro-batch of an optimizer step
            self._window_open = True
            self._step_before = trainer.global_step
            self._comm_before = _comm_bytes()
            self._state = None
        count, self._unit = count_tokens(batch)
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is None or pipeline.runner.is_first:  # the ranks of one pipeline share their batches
            self._interval_tokens += count

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Right after backward is when model state peaks (gradients exist) and what the formulas describe.
        if self._logs_at(trainer, trainer.global_step + 1):
            engine = getattr(trainer.strategy, "engine", None)
            self._state = model_state_bytes(pl_module, trainer.optimizers, engine)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # The gradients are final here (averaged, unscaled), before clipping; every rank reaches this collective.
        if (
            self.grad_norm_type is not None
            and pl_module.automatic_optimization
            and self._logs_at(trainer, trainer.global_step + 1)
        ):
            norms = grad_norm(pl_module, self.grad_norm_type)
            self._grad_norm = float(norms.get(f"grad_{self.grad_norm_type}_norm_total", math.nan))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_before:
            return  # an accumulation micro-batch: the step is not over yet
        self._window_open = False
        # Every rank decides from the step count alone, so all of them reach the gather below.
        if not self._logs_at(trainer, trainer.global_step):
            return
        device = trainer.strategy.root_device
        comm, inter_node = (now - before for now, before in zip(_comm_bytes(), self._comm_before))
        seconds = _now(device) - (self._interval_started or 0.0)
        state: Mapping[str, float] = self._state or dict.fromkeys(
            ("device", "host"), math.nan
        )  # e.g. a step without backward
        mine = torch.tensor(
            [
                state["device"] + state["host"],
                state["device"],
                state["host"],
                peak_memory_bytes(device),
                comm,
                self._interval_tokens / max(seconds, 1e-9),
                inter_node,
            ],
            dtype=torch.float64,
        )
        ranks = _gather(mine, device)  # (world, 7)
        self._interval_started, self._interval_tokens = _now(device), 0
        metrics: dict[str, float] = {}
        offloaded = bool((ranks[:, 2] > 0).any())
        for rank, row in enumerate(ranks.tolist()):
            metrics[f"monitor/state_MiB_rank{rank}"] = row[0] / MIB
            if offloaded:
                metrics[f"monitor/device_MiB_rank{rank}"] = row[1] / MIB
                metrics[f"monitor/host_MiB_rank{rank}"] = row[2] / MIB
            metrics[f"monitor/peak_MiB_rank{rank}"] = row[3] / MIB
        metrics["monitor/state_MiB_max"] = float(ranks[:, 0].max()) / MIB
        metrics["monitor/comm_MiB_per_step"] = float(ranks[:, 4].max()) / MIB
        metrics["monitor/comm_inter_node_MiB"] = float(ranks[:, 6].max()) / MIB
        metrics[f"monitor/{self._unit}_per_s"] = float(ranks[:, 5].sum())
        scale = loss_scale(trainer.strategy.precision_plugin)
        if scale is not None:
            metrics["monitor/loss_scale"] = scale
        if self._grad_norm is not None:
            metrics[f"monitor/grad_{self.grad_norm_type:g}_norm"] = self._grad_norm
            self._grad_norm = None
        self.last = metrics
        # Straight to the loggers: `self.log` would wait for the Trainer's own logging cadence. The step is
        # the one Lightning writes its own metrics of this optimizer step under.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)
        if self.prog_bar:
            short = {
                "state_MiB": "monitor/state_MiB_max",
                "comm_MiB": "monitor/comm_MiB_per_step",
                "tok/s" if self._unit == "tokens" else "samples/s": f"monitor/{self._unit}_per_s",
            }
            for label, name in short.items():
                pl_module.log(
                    label, metrics[name], on_step=True, on_epoch=False, prog_bar=True, logger=False, rank_zero_only=True
                )


def _comm_bytes() -> tuple[int, int]:
    counts = comm_stats().snapshot()
    return counts["bytes"], counts["bytes_inter_node"]


def loss_scale(plugin: Any) -> float | None:
    """The current fp16 loss scale: ZeroPrecision's dynamic scaler, or Lightning's ``torch.amp.GradScaler``."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is None:
        return None
    if callable(getattr(scaler, "get_scale", None)):
        return float(scaler.get_scale()) if scaler.is_enabled() else None
    value = getattr(scaler, "scale", None)
    return float(value) if isinstance(value, (int, float)) else None


def _now(device: torch.device) -> float:
    """Wall time, after the accelerator's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _gather(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's row, on the CPU; the monitor's own collective, outside the counted ones."""
    return collectives.all_gather_uncounted(tensor.to(device)).cpu()
