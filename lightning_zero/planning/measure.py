"""The measured side of the planner's calibration: a run's peak of live tensor bytes per rank.

On a GPU ``torch.cuda.max_memory_allocated`` is the peak. On a CPU there is no allocator statistic, and the
process's RSS includes the interpreter, libraries and freed-but-cached pages, so the peak is counted from the
tensors themselves: torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a ``TorchDispatchMode``
that follows every storage, storage resizes included, to its release) runs over the measured steps, with
every tensor alive when it starts handed to it, so frees of older tensors (the previous step's gradients)
count too. What the run holds before the strategy sets up, other than the module's parameters (a dataset held
as tensors, say), is the *baseline* and is not the run's: the figure reported is the peak minus it.
"""

from __future__ import annotations

import gc

import lightning as L
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from lightning_zero.memory import live_tensor_bytes


class _TotalsOnly(MemTracker):
    """``MemTracker`` without its per-module statistics, which refuse a root module called twice in one
    iteration (a ``training_step`` that calls ``self(...)`` through Lightning's forward redirection does that).
    The totals come from its dispatch mode and storage tracking alone."""

    def _pre_fw_hook(self, module, inputs) -> None:
        pass

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass


def _live_tensors() -> list[torch.Tensor]:
    """Every live tensor the garbage collector knows (DTensors by their local shard), meta ones left out."""
    gc.collect()
    out = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                tensor = obj._local_tensor if isinstance(obj, DTensor) else obj
                if not tensor.is_meta:
                    out.append(tensor)
        except (RuntimeError, NotImplementedError):
            continue
    return out


class PeakMemory(L.Callback):
    """Measure the peak of live tensor bytes over training batches ``[first, first + count)`` (collective at the
    end: every rank's peak is gathered). ``peaks``: bytes per rank above the baseline; on CUDA the device's
    ``max_memory_allocated`` over the same batches, less the same baseline."""

    def __init__(self, first: int = 1, count: int = 2) -> None:
        self.first, self.count = first, count
        self.peaks: list[int] = []
        self._baseline = 0
        self._tracker: MemTracker | None = None
        self._peak = 0

    def setup(self, trainer, pl_module, stage) -> None:
        params = sum(p.untyped_storage().nbytes() for p in pl_module.parameters() if not p.is_meta)
        self._baseline = live_tensor_bytes() - params

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != self.first:
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            return
        tracker = _TotalsOnly()
        tracker.track_external(*_live_tensors())
        tracker.__enter__()
        self._tracker = tracker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != self.first + self.count - 1:
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            tracker, self._tracker = self._tracker, None
            snapshot = tracker.get_tracker_snapshot("peak")
            tracker.__exit__(None, None, None)
            peak = sum(per_device.get("Total", 0) for per_device in snapshot.values())
        self._peak = peak - self._baseline
        gathered = trainer.strategy.all_gather(torch.tensor([self._peak], dtype=torch.int64))
        self.peaks = [int(v) for v in gathered.reshape(-1).tolist()]
