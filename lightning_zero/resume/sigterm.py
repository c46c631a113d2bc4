"""The checkpoint a run takes when the job receives SIGTERM (what a scheduler sends before preemption).

Lightning raises ``SIGTERMException`` in the training loop once the signal's flag is seen; ZeroStrategy then
saves ``sigterm.ckpt`` into the first ``ModelCheckpoint``'s directory (overwriting an earlier one, atomically),
where auto-resume and ``ckpt_path="last"`` find it. It saves only when that is safe:

* every rank stopped at the same batch boundary. Lightning raises the exception either after the per-batch
  broadcast of rank 0's flag (all ranks together) or at the end of a batch from each rank's own flag (ranks
  that saw the signal a moment later go on into the next batch). The save is collective, so the ranks first
  compare where they stopped through the process group's store -- not a collective, which could pair with a
  peer's next training collective -- and save only if all of them arrived within a few seconds at the same
  place;
* between training batches (Lightning also raises it mid-validation, where the RNG draws of the unfinished
  validation could not be replayed), at an accumulation-window boundary (automatic optimization):
  accumulated gradients are not part of a checkpoint, so a save inside a window would lose micro-batches;
* when training has started and no ``OnExceptionCheckpoint`` callback already saves on the exception.

The save has to end before the scheduler's SIGKILL (commonly 30 s after SIGTERM; ZeroStrategy's watchdog also
ends a process that has not exited by then). A save that fails or is killed leaves every earlier checkpoint
intact: checkpoints are written under a temporary name and renamed.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_zero.resume.newest_checkpoint import SIGTERM_CHECKPOINT

log = logging.getLogger(__name__)

#: How long a rank that stopped waits for the others to report where they stopped.
AGREE_SECONDS = 5.0

_serial = itertools.count()


def save_on_sigterm(trainer: pl.Trainer, exception: BaseException, wait: float = AGREE_SECONDS) -> Path | None:
    """Save ``sigterm.ckpt`` if ``exception`` is Lightning's SIGTERMException and it is safe; return its path."""
    if not isinstance(exception, SIGTERMException):
        return None
    reason = _unsafe(trainer)
    if reason is None:
        reason = _not_all_ranks_here(_stop_point(trainer), wait)
    if reason is not None:
        rank_zero_info(f"SIGTERM: no checkpoint taken ({reason}).")
        return None
    directory = getattr(trainer.checkpoint_callback, "dirpath")  # checked by _unsafe; Checkpoint declares none
    path = Path(directory) / SIGTERM_CHECKPOINT
    started = time.monotonic()
    try:
        trainer.save_checkpoint(path)
    except Exception as err:  # noqa: BLE001 - the SIGTERMException must still end the run
        log.error(
            "SIGTERM: saving %s failed on rank %d (%s: %s); earlier checkpoints are intact.",
            path,
            trainer.global_rank,
            type(err).__name__,
            err,
        )
        return None
    rank_zero_info(
        f"SIGTERM: saved {path} at global step {trainer.global_step} in {time.monotonic() - started:.1f} s; "
        "a restarted job resumes from it (auto_resume, or ckpt_path='last')."
    )
    return path


def _unsafe(trainer: pl.Trainer) -> str | None:
    """Why no checkpoint can be taken here (None: it can)."""
    if trainer.state.fn != TrainerFn.FITTING or trainer.lightning_module is None:
        return "not fitting"
    if not trainer.training:  # e.g. Lightning's evaluation loop raised it mid-validation
        stage = trainer.state.stage.value if trainer.state.stage is not None else "not running"
        return f"stopped in the {stage} stage, not between training batches"
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector, undeclared
    if any(isinstance(cb, OnExceptionCheckpoint) for cb in callbacks):
        return "an OnExceptionCheckpoint callback saves on exceptions"
    callback = trainer.checkpoint_callback
    if callback is None or not getattr(callback, "dirpath", None):
        return "no ModelCheckpoint directory to save into"
    progress = trainer.fit_loop.epoch_loop.batch_progress
    ready = progress.current.ready
    accumulate = trainer.accumulate_grad_batches
    boundary = ready % accumulate == 0 or ready == trainer.num_training_batches or progress.is_last_batch
    if trainer.lightning_module.automatic_optimization and not boundary:
        return (
            f"batch {ready} of the epoch is inside an accumulation window of {accumulate}; accumulated "
            "gradients are not part of a checkpoint"
        )
    return None


def _stop_point(trainer: pl.Trainer) -> list[int]:
    progress = trainer.fit_loop.epoch_loop.batch_progress.total
    return [trainer.current_epoch, trainer.global_step, progress.ready, progress.completed]


def _not_all_ranks_here(point: list[int], wait: float) -> str | None:
    """Compare every rank's stop point through the process group's store (see the module docstring)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    # The process group's store is this attempt's own, also under torchrun's shared store (attempt_store.py).
    key = f"lightning_zero/sigterm/{next(_serial)}/{'-'.join(map(str, point))}"
    store.set(f"{key}/{rank}", json.dumps(point))
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=wait))
    except Exception:  # noqa: BLE001 - a timeout: some rank did not stop here
        absent = [r for r in range(world) if not store.check([keys[r]])]
        return f"rank(s) {absent} did not stop at the same batch within {wait:g} s"
    points = [json.loads(store.get(k)) for k in keys]
    if any(p != point for p in points):
        return "the ranks stopped at different batches: " + ", ".join(f"rank {r}: {p}" for r, p in enumerate(points))
    return None
