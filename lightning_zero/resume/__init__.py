"""Surviving a lost process: auto-resume under launcher restarts, exact mid-epoch resume, the SIGTERM checkpoint.

* :mod:`.ckpt_path`, :mod:`.newest_checkpoint`, :mod:`.agreement`: which checkpoint a (restarted) fit loads;
* :mod:`.position`, :mod:`.sampler`: where in the data the resumed run continues, and a DataLoader that does;
* :mod:`.state`: the order in which a resume happens across the strategy's hooks (RNG included);
* :mod:`.sigterm`: the checkpoint taken when the job receives SIGTERM.

Nothing here changes the checkpoint format: a resume reads what ``trainer.save_checkpoint`` wrote.
"""

from lightning_zero.resume.ckpt_path import ResumeDecision, resolve_ckpt_path
from lightning_zero.resume.newest_checkpoint import (
    SIGTERM_CHECKPOINT,
    checkpoint_directories,
    restart_count,
    resume_candidates,
)
from lightning_zero.resume.position import DataPosition, position_from_loops
from lightning_zero.resume.state import ResumeState

__all__ = [
    "SIGTERM_CHECKPOINT",
    "DataPosition",
    "ResumeDecision",
    "ResumeState",
    "checkpoint_directories",
    "position_from_loops",
    "resolve_ckpt_path",
    "restart_count",
    "resume_candidates",
]
