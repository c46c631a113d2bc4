"""Turning the ``ckpt_path`` a user passed (or did not pass) into the checkpoint a run loads.

Called by ZeroStrategy's launchers (:mod:`lightning_zero.strategy.launcher`) just before Lightning's ``_fit_impl`` /
``_validate_impl`` / ... run, which is the last point where ``ckpt_path`` can still be chosen: Lightning resolves
it before the process group exists.

* ``fit(ckpt_path=None)`` in a process the launcher restarted (``TORCHELASTIC_RESTART_COUNT`` or
  ``SLURM_RESTART_COUNT`` > 0, or a newest checkpoint written by this same job: see :mod:`.agreement`), with
  ``ZeroStrategy(auto_resume=True)``: the newest complete checkpoint (:mod:`.newest_checkpoint`), checked to be every
  rank's once the process group exists. An explicit ``ckpt_path`` always wins.
* ``ckpt_path="last"`` (any trainer function): Lightning's own "last" candidates plus the SIGTERM checkpoint,
  complete ones only.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_zero.checkpoint.verify import META_FILE, CheckpointError, read_checkpoint_dict
from lightning_zero.resume.agreement import JOB_KEY, same_job
from lightning_zero.resume.newest_checkpoint import (
    RESTART_VARIABLES,
    checkpoint_directories,
    resolve_last,
    restart_count,
    resume_candidates,
)


@dataclasses.dataclass(frozen=True)
class ResumeDecision:
    """What auto-resume chose for one ``fit``, on this rank."""

    path: str | None
    """The checkpoint to resume from, or None to start from the beginning."""

    restarts: int
    """This process's restart count (0: the first attempt, or a restart the launcher did not count)."""


def resolve_ckpt_path(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trainer: pl.Trainer | None,
    auto_resume: bool,
) -> tuple[tuple[Any, ...], dict[str, Any], ResumeDecision | None]:
    """``function``'s arguments with ``ckpt_path`` resolved, and the auto-resume decision when one was made."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs, None
    if trainer is None or "ckpt_path" not in bound.signature.parameters:
        return args, kwargs, None
    given = bound.arguments.get("ckpt_path")
    decision = None
    if given == "last" and hasattr(ModelCheckpoint, "_find_last_checkpoints"):  # else Lightning resolves it
        bound.arguments["ckpt_path"] = resolve_last(trainer)
        if bound.arguments["ckpt_path"] is None:
            rank_zero_warn('ckpt_path="last": there is no complete last checkpoint; starting from the beginning.')
    elif given is None and auto_resume and _applies(trainer):
        decision = decide(trainer)
        bound.arguments["ckpt_path"] = decision.path
    return bound.args, bound.kwargs, decision


def _applies(trainer: pl.Trainer) -> bool:
    """A fit that could be a restart, and in which the user has not chosen the checkpoint (``trainer.ckpt_path =``
    is Lightning's other way to name one)."""
    user_chose = getattr(trainer._checkpoint_connector, "_user_managed", False)
    launched = any(name in os.environ for name in RESTART_VARIABLES)
    return trainer.state.fn == TrainerFn.FITTING and launched and not user_chose


def decide(trainer: pl.Trainer) -> ResumeDecision:
    """Resume from the newest complete checkpoint when this process is a restart, or when that checkpoint was
    written by this same launcher job (a node whose restart was not counted, see :mod:`.agreement`); the
    ranks' choices are compared once the process group exists."""
    candidates = resume_candidates(trainer)
    restarts = restart_count()
    newest = candidates[0] if candidates else None
    ours = newest is not None and same_job(_recorded_job(newest.path))
    if restarts == 0 and not ours:
        return ResumeDecision(None, 0)
    directories = ", ".join(str(d) for d in checkpoint_directories(trainer)) or "(none: no ModelCheckpoint)"
    why = f"restart {restarts} of this job" if restarts else "a restart of this job (its checkpoint is this job's)"
    if newest is None:
        rank_zero_info(
            f"Auto-resume: {why}, but no complete checkpoint in {directories}; training starts from the beginning."
        )
        return ResumeDecision(None, restarts)
    step = f" (global step {newest.global_step})" if newest.global_step is not None else ""
    rank_zero_info(
        f"Auto-resume: {why}; resuming from {newest.path}{step}, the newest complete checkpoint in {directories}."
    )
    return ResumeDecision(str(newest.path), restarts)


def _recorded_job(path: Path) -> object:
    """The launcher job a checkpoint records (``JOB_KEY``), or None where it cannot be read cheaply."""
    try:
        return read_checkpoint_dict(path / META_FILE if path.is_dir() else path, mmap=path.is_file()).get(JOB_KEY)
    except (CheckpointError, OSError):
        return None
