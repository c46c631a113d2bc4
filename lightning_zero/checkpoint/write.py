"""Writing checkpoints so that a failure or a kill at any point leaves the previous one intact.

Protocol of a sharded save (collective; ``group`` is the world, or the dedicated group of an asynchronous
save, see ``async_save.py``):

1. :func:`prepare`: rank 0 picks the temporary ``.{name}.tmp-{8 hex}`` and tells every rank; it removes
   what earlier interrupted saves of that name left, creates the temporary and writes ``meta.pt`` (the
   trainer's non-tensor state, small) into it.
2. :func:`write_shards`: every rank writes its rows with ``torch.distributed.checkpoint`` (DCP gathers
   every rank's write result to rank 0, which writes ``.metadata``; a failure anywhere raises everywhere).
3. :func:`publish`: every rank checksums the files it wrote; rank 0 writes ``manifest.json`` with every
   rank's CRC-32s and renames the temporary to the final name.

Every step ends in an all-gather of each rank's failure (``errors.on_every_rank``), so a rank
whose write fails (a full disk, say) never leaves its peers waiting, and every rank raises the same
:class:`CheckpointSaveError`. On failure rank 0 removes the temporary.

A full save is one rank-local step: rank 0 writes the file beside the final name and renames it; every rank
learns the outcome from one all-gather.

Ranks wait here for the slowest writer (or, for a full save, for rank 0): the strategy lifts the run's
collective timeout around a save (``faults.extended``), as that wait is not a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero.checkpoint import delayed_update, error_feedback, selective_updates
from lightning_zero.checkpoint.errors import on_every_rank, reraise, save_error
from lightning_zero.checkpoint.files import (
    remove,
    remove_temporaries,
    replace,
    save_torch,
    temporary_path,
    write_durably,
)
from lightning_zero.checkpoint.layout import as_full_file
from lightning_zero.checkpoint.state_dicts import CURRENT_MODEL_STATE
from lightning_zero.checkpoint.verify import DCP_METADATA_FILE, MANIFEST_FILE, META_FILE, describe_files, manifest_text
from lightning_zero.engine.comm import collectives


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors for DCP, the rest for meta.pt)``: the model and optimizer states go to DCP, keyed
    ``state_dict`` (and ``current_model_state``) and ``optimizer_{i}``; each optimizer's param groups (names and
    hyperparameters) stay in ``meta.pt``. Takes ``checkpoint`` apart (it is Lightning's freshly built dict)."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    if CURRENT_MODEL_STATE in checkpoint:  # WeightAveraging's trained weights, beside their average in "state_dict"
        tensors[CURRENT_MODEL_STATE] = checkpoint.pop(CURRENT_MODEL_STATE)
    if error_feedback.KEY in checkpoint:  # this rank's residuals (error_feedback.py); their tables stay in meta.pt
        tensors[error_feedback.KEY] = checkpoint.pop(error_feedback.KEY)
    if delayed_update.KEY in checkpoint:  # the parameters one update behind (delayed_update.py)
        tensors[delayed_update.KEY] = checkpoint.pop(delayed_update.KEY)
    if selective_updates.KEY in checkpoint:  # sums, columns and counts of selective updates (selective_updates.py)
        tensors[selective_updates.KEY] = checkpoint.pop(selective_updates.KEY)
    for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = optim_state["state"]
        checkpoint.setdefault("optimizer_param_groups", []).append(optim_state["param_groups"])
    return tensors, checkpoint


class ShardWriter(FileSystemWriter):
    """DCP's file writer, with a failure described on the rank where it happens.

    DCP pickles each rank's exception to rank 0, which loses ``__context__``: the ``OSError`` behind torch's
    ``unexpected pos`` (ENOSPC, EFBIG) would be gone by the time any rank reports it.
    """

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
            future.wait()
        except Exception as err:
            reraise(err, f"a shard file in {self.path}")
        return future

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as err:
            reraise(err, f"{self.path}/{DCP_METADATA_FILE}")


def save_sharded(checkpoint: dict[str, Any], path: Path) -> None:
    """Collective: write ``checkpoint`` as a sharded directory at ``path`` (see the module docstring)."""
    tensors, meta = split_checkpoint(checkpoint)
    tmp, previous = prepare(path, meta)
    try:
        write_shards(tensors, tmp, path, previous)
        publish(tmp, path, previous)
    finally:
        if collectives.rank() == 0:
            remove(tmp)  # nothing left there after a successful rename


def prepare(path: Path, meta: dict[str, Any], group=None) -> tuple[Path, bool]:
    """Step 1. Returns ``(temporary directory, whether a previous checkpoint exists at path)``."""
    rank = collectives.rank(group)
    tmp, previous = collectives.broadcast_object((temporary_path(path), path.exists()), group=group)

    def start() -> None:
        if rank != 0:
            return
        try:
            remove_temporaries(path)
            tmp.mkdir(parents=True)
            save_torch(meta, tmp / META_FILE)
        except Exception as err:
            remove(tmp)
            reraise(err, str(tmp / META_FILE))

    on_every_rank(start, lambda failures: save_error(path, failures, previous), group)
    return tmp, previous


def write_shards(tensors: dict[str, Any], tmp: Path, path: Path, previous: bool, group=None) -> None:
    """Step 2: this rank's rows into ``tmp`` (collective)."""
    try:
        dcp.save(tensors, storage_writer=ShardWriter(tmp), process_group=group)
    except CheckpointException as err:  # a BaseException in torch: raise an ordinary error, the same everywhere
        failures = {rank: (f[0] if isinstance(f, tuple) else f) for rank, f in err.failures.items()}
        raise save_error(path, failures, previous) from None


def publish(tmp: Path, path: Path, previous: bool, group=None, before_rename: Callable[[], None] | None = None) -> None:
    """Step 3: checksums, manifest, rename (collective). ``before_rename``: a rank-local check that may still
    call the save off (by raising) on every rank."""
    rank = collectives.rank(group)

    def checksum() -> dict[str, dict[str, int]]:
        if before_rename is not None:
            before_rename()
        mine = [p.name for p in tmp.glob(f"__{rank}_*")] + ([DCP_METADATA_FILE, META_FILE] if rank == 0 else [])
        return describe_files(tmp, mine)

    make_error = lambda failures: save_error(path, failures, previous)  # noqa: E731
    described = on_every_rank(checksum, make_error, group)

    def rename() -> None:
        if rank == 0:
            files = {name: entry for files in described for name, entry in files.items()}
            write_durably(tmp / MANIFEST_FILE, lambda f: f.write(manifest_text(files).encode()))
            replace(tmp, path)

    on_every_rank(rename, make_error, group)


def save_full(checkpoint: dict[str, Any], path: Path) -> None:
    """Collective: rank 0 writes ``checkpoint`` to one file at ``path`` (a Fabric loop's under its own keys:
    ``layout.py``); every rank raises if it failed."""
    rank = collectives.rank()
    tmp, previous = collectives.broadcast_object((temporary_path(path), path.exists()))

    def write() -> None:
        if rank == 0:
            write_full(as_full_file(checkpoint), path, tmp)

    on_every_rank(write, lambda failures: save_error(path, failures, previous))


def write_full(checkpoint: dict[str, Any], path: Path, tmp: Path | None = None) -> None:
    """Rank-local: ``checkpoint`` to ``tmp`` (a temporary sibling), synced, then renamed to ``path``."""
    tmp = tmp or temporary_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_temporaries(path)
        save_torch(checkpoint, tmp)
        replace(tmp, path)
    except Exception as err:
        reraise(err, str(tmp))
    finally:
        remove(tmp)
