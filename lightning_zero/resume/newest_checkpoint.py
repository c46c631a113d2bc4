"""Which checkpoint a fit resumes from when the user did not name one: the newest *complete* checkpoint in the
directories the trainer's checkpoint callbacks write to.

Directories searched (:func:`checkpoint_directories`):

* each ``ModelCheckpoint``'s ``dirpath`` when it is set -- the reliable case;
* a ``ModelCheckpoint`` without ``dirpath`` writes under the first logger's version directory, and a restarted
  process starts a *new* version (``version_1``...), so every version directory of that logger is searched
  (``{save_dir}/{name}/*/checkpoints``; CSV and TensorBoard loggers, whose layout is known), or
  ``{default_root_dir}/checkpoints`` without a logger; other loggers need ``dirpath`` (a warning says so);
* each ``OnExceptionCheckpoint``'s ``dirpath``;
* under SLURM, ``default_root_dir`` for Lightning's ``hpc_ckpt_*`` requeue checkpoints.

A checkpoint counts when :func:`~lightning_zero.checkpoint.listing.list_checkpoints` calls it complete (manifest,
sizes, ``meta.pt``; the CRC of every shard is checked when it is loaded); temporaries of a save that died and
damaged checkpoints are passed over, and the log says so. Newest means most recently completed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_zero.checkpoint.listing import CheckpointEntry, inspect_checkpoint, list_checkpoints

log = logging.getLogger(__name__)

#: The checkpoint ZeroStrategy writes when the job receives SIGTERM (see :mod:`.sigterm`), in the first
#: ``ModelCheckpoint``'s directory.
SIGTERM_CHECKPOINT = "sigterm.ckpt"

#: Environment variables by which launchers say a process is a restart of a failed one.
RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_count() -> int:
    """How many times the launcher has restarted this job (0 on the first attempt or without a launcher)."""
    counts = []
    for name in RESTART_VARIABLES:
        try:
            counts.append(int(os.environ.get(name, "0")))
        except ValueError:
            counts.append(0)
    return max(counts)


def checkpoint_directories(trainer: pl.Trainer) -> list[Path]:
    """The local directories auto-resume searches, in the order of the callbacks (see the module docstring)."""
    found: list[Path] = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's connector, undeclared
        if isinstance(callback, ModelCheckpoint):
            found.extend([Path(callback.dirpath)] if callback.dirpath else _default_directories(trainer))
        elif isinstance(callback, OnExceptionCheckpoint):
            found.append(Path(callback.dirpath))
    local = [d for d in found if "://" not in str(d)]
    for remote in sorted({str(d) for d in found} - {str(d) for d in local}):
        rank_zero_warn(f"Auto-resume only searches local directories; {remote} is not searched.")
    return list(dict.fromkeys(local))


def _default_directories(trainer: pl.Trainer) -> list[Path]:
    if not trainer.loggers:
        return [Path(trainer.default_root_dir) / "checkpoints"]
    logger = trainer.loggers[0]
    if isinstance(logger, (CSVLogger, TensorBoardLogger)):
        root = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)
        return sorted(p for p in root.glob("*/checkpoints") if p.is_dir())
    rank_zero_warn(
        f"Auto-resume cannot tell where ModelCheckpoint saves with a {type(logger).__name__} and no `dirpath`: the "
        "directory changes with the logger's version on every restart. Set `ModelCheckpoint(dirpath=...)`."
    )
    return []


def resume_candidates(trainer: pl.Trainer) -> list[CheckpointEntry]:
    """Every complete checkpoint auto-resume may pick, newest first (see the module docstring)."""
    entries = complete_checkpoints(checkpoint_directories(trainer))
    if os.environ.get("SLURM_JOB_ID"):  # Lightning's SLURM requeue handler saves hpc_ckpt_<n>.ckpt there
        hpc = complete_checkpoints([Path(trainer.default_root_dir)])
        entries += [e for e in hpc if e.path.name.startswith("hpc_ckpt_")]
    unique = {e.path: e for e in entries}
    return sorted(unique.values(), key=lambda e: (e.mtime, e.global_step or 0), reverse=True)


def complete_checkpoints(directories: Iterable[Path]) -> list[CheckpointEntry]:
    """Every complete checkpoint in ``directories``, newest first; incomplete and damaged ones are logged."""
    entries = []
    for directory in directories:
        for entry in list_checkpoints(directory):
            if entry.complete:
                entries.append(entry)
            else:
                log.info("auto-resume passes over %s (%s): %s", entry.path, entry.status, entry.problem)
    return sorted(entries, key=lambda e: (e.mtime, e.global_step or 0), reverse=True)


def resolve_last(trainer: pl.Trainer) -> str | None:
    """``ckpt_path="last"`` as Lightning resolves it (``last*.ckpt`` of every ModelCheckpoint, the
    OnExceptionCheckpoint file) plus ZeroStrategy's SIGTERM checkpoint, keeping only complete checkpoints:
    the newest one, or None when there is none (Lightning then warns and starts fresh, as for "last")."""
    candidates: set[Path] = set()
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's connector, undeclared
        if isinstance(callback, ModelCheckpoint):
            candidates |= {Path(p) for p in callback._find_last_checkpoints(trainer)}  # lightning 2.x
            if callback.dirpath:
                candidates.add(Path(callback.dirpath) / SIGTERM_CHECKPOINT)
        elif isinstance(callback, OnExceptionCheckpoint):
            candidates.add(Path(callback.ckpt_path))
    complete = []
    for path in sorted(p for p in candidates if p.exists()):
        entry = inspect_checkpoint(path)
        if entry.complete:
            complete.append(entry)
        else:
            rank_zero_warn(f'ckpt_path="last" passes over {path} ({entry.status}): {entry.problem}')
    if not complete:
        return None
    return str(max(complete, key=lambda e: (e.mtime, e.global_step or 0)).path)
