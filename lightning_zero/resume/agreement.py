"""Every rank resumes from the same checkpoint, or none does.

The choice is made before the process group exists (Lightning fixes ``ckpt_path`` before ``setup_environment``),
by every rank on its own, from what it can see. Two things can make ranks differ:

* the restart count. Measured with torch 2.13 (two torchrun agents, ``--nnodes 2``): when a worker on node A is
  killed, agent A restarts its workers with ``TORCHELASTIC_RESTART_COUNT=1``, but agent B, whose workers were
  still alive, restarts them for the membership change with the count unchanged (0) -- with NCCL, where a
  lost peer is not noticed, that is the usual case. The ranks cannot compare counts before the process group
  exists: torchrun's shared store keeps the keys of earlier attempts (measured: a restarted rank reads the
  previous attempt's values). So a rank also resumes when the newest checkpoint was written by this same
  torchrun job (:func:`job_identity`, recorded in every checkpoint): a node whose count stayed 0 then
  decides as the restarted one does;
* the files a rank can see (node-local checkpoint directories).

After the process group exists, :func:`check_agreement` compares every rank's choice and whether it can read
it, and raises the same clear error on every rank instead of letting the loads diverge.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_zero.engine.comm import collectives

#: Checkpoint key of :func:`job_identity`.
JOB_KEY = "lightning_zero_job"


def job_identity() -> dict[str, str]:
    """What identifies the launcher job this process belongs to, across its restarts: torchrun's rendezvous id
    (``--rdzv-id``; ``--standalone`` draws one per job; torchrun's default "none" identifies nothing) and
    SLURM's job id."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    job = {
        "torchelastic_run_id": run_id if run_id not in ("", "none") else "",
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
    }
    return {k: v for k, v in job.items() if v}


def same_job(recorded: object) -> bool:
    """Whether a checkpoint's recorded :func:`job_identity` is this job's (by any identifier both have)."""
    mine = job_identity()
    if not isinstance(recorded, dict) or not mine:
        return False
    return any(recorded.get(key) == value for key, value in mine.items())


def check_agreement(path: str | None) -> None:
    """Collective. Raise on every rank unless every rank resumes from ``path`` (or none does) and can read it."""
    visible = path is None or Path(path).exists()
    views = collectives.all_gather_objects((path, visible))
    paths = {p for p, _ in views}
    if len(paths) > 1:
        listing = ", ".join(f"rank {r}: {p or 'no checkpoint'}" for r, (p, _) in enumerate(views))
        raise RuntimeError(
            f"Auto-resume: the ranks chose different checkpoints ({listing}). Put the checkpoint directory on "
            "storage every node shares, or pass the same `ckpt_path` to `fit` on every rank."
        )
    blind = [r for r, (_, seen) in enumerate(views) if not seen]
    if blind:
        raise RuntimeError(
            f"Auto-resume: rank(s) {blind} cannot read {path}, which the others resume from. The checkpoint "
            "directory must be on storage every node shares."
        )
