"""The measured side of the planner's calibration: a run's peak of live tensor bytes per rank.

On a GPU ``torch.cuda.max_memory_allocated`` is the peak. On a CPU there is no allocator statistic, and the
process's RSS includes the interpreter, libraries and freed-but-cached pages, so the peak is counted from the
tensors themselves: torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a ``TorchDispatchMode``
that follows every storage, storage resizes included, to its release) runs over the measured batches. It is
handed the run's own tensors alive when it starts (parameters and their gradients, optimizer state, the engine's
masters and gradient buffers, the batch) and sees everything allocated after; what else the process holds (a
dataset in memory, an earlier run's leftovers) is not the run's and is not counted.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zero.torch_versions.tracing import MemTracker, tree_leaves

#: What ``MemTracker.track_external`` accepts.
_Tracked = nn.Module | torch.optim.Optimizer | torch.Tensor


class _TotalsOnly(MemTracker):
    """``MemTracker`` without its per-module statistics, which refuse a root module called twice in one
    iteration (a ``training_step`` that calls ``self(...)`` through Lightning's forward redirection does that).
    The totals come from its dispatch mode and storage tracking alone."""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        pass

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        pass

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass


def _run_tensors(trainer: L.Trainer, module: L.LightningModule, batch: Any) -> list[_Tracked]:
    """What the run holds when the window opens: the module (parameters, buffers, gradients), the optimizers and
    the tensors they key their state by, the engine's own state (masters, gradient shards and buffers), the batch."""
    optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
    held: list[_Tracked] = [module, *optimizers]
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        held += [tensor for _, tensor, _ in engine.state_tensors()]
        for optimizer in optimizers:
            held += list(engine.optimizer_shards(optimizer).hosted().values())
    held += [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return [t._local_tensor if isinstance(t, DTensor) else t for t in held]


class PeakWindow:
    """The peak of the run's live tensor bytes between :meth:`open` and :meth:`close` (see the module docstring): on
    CUDA the device's ``max_memory_allocated`` over the window, on a CPU ``MemTracker`` handed the run's tensors."""

    def __init__(self) -> None:
        self._tracker: MemTracker | None = None

    def open(self, trainer: L.Trainer, module: L.LightningModule, batch: Any) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            return
        tracker = _TotalsOnly()
        tracker.track_external(*_run_tensors(trainer, module, batch))
        tracker.__enter__()
        self._tracker = tracker

    def close(self, trainer: L.Trainer) -> int:
        """The window's peak on this rank."""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device)
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            raise RuntimeError("lightning_zero internal error: a peak window closed before it opened")
        snapshot = tracker.get_tracker_snapshot("peak")
        tracker.__exit__(None, None, None)
        return sum(per_device.get("Total", 0) for per_device in snapshot.values())

    def abandon(self) -> None:
        """Stop measuring without a figure (a run that ends inside the window): the dispatch mode and hooks go."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)


class PeakMemory(L.Callback):
    """Measure the peak of the run's live tensor bytes over training batches ``[first, first + count)`` (collective
    at the end: every rank's peak is gathered into ``peaks``); on CUDA the device's ``max_memory_allocated`` over
    the same batches. By default the window is the second optimizer step's accumulation window, whole: the first
    step creates the optimizer state, so a window before it would miss that state."""

    def __init__(self, first: int | None = None, count: int | None = None) -> None:
        self.first, self.count = first, count
        self.peaks: list[int] = []
        self._window = PeakWindow()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        accumulate = trainer.accumulate_grad_batches
        self.first = accumulate if self.first is None else self.first
        self.count = accumulate if self.count is None else self.count

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.first:
            self._window.open(trainer, pl_module, batch)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.first is None or self.count is None:
            raise RuntimeError("PeakMemory: the window is set in on_train_start, before any batch.")
        if batch_idx != self.first + self.count - 1:
            return
        gathered = trainer.strategy.all_gather(torch.tensor([self._window.close(trainer)], dtype=torch.int64))
        self.peaks = [int(v) for v in gathered.reshape(-1).tolist()]
