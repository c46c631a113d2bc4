"""What checkpoints a directory holds, and which of them can be resumed from.

:func:`list_checkpoints` is what auto-resume asks for "the newest complete checkpoint" and what
``lightning-zero verify`` prints (searching the folders below too). It reads no tensor data: a sharded checkpoint
is judged by its manifest (every listed file present with its recorded size) and its ``meta.pt``; a full one by its
archive's directory. ``verify=True`` also compares every CRC-32 (reading every byte) and parses the metadata files
with the safe readers, as a load would.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from lightning_zero.checkpoint.files import parse_temporary
from lightning_zero.checkpoint.safe_load import read_dcp_metadata
from lightning_zero.checkpoint.verify import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    META_FILE,
    CheckpointError,
    read_checkpoint_dict,
    verify_archive,
    verify_files,
)

CheckpointKind = Literal["sharded", "full"]
CheckpointStatus = Literal["complete", "incomplete", "corrupted"]

#: The suffix of a full checkpoint file that a directory listing picks up (Lightning's ``ModelCheckpoint``
#: names sharded directories the same way). A file named otherwise can still be inspected by path.
FULL_SUFFIX = ".ckpt"


@dataclasses.dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint (or the remains of an unfinished save) found on disk."""

    path: Path
    """The checkpoint: a sharded directory or a full file (for ``"incomplete"``: the temporary itself)."""

    kind: CheckpointKind
    """``"sharded"`` (a directory written by every rank) or ``"full"`` (one file written by rank 0)."""

    status: CheckpointStatus
    """``"complete"``: whole, can be resumed from. ``"incomplete"``: a temporary left by a save that did not
    finish (its writer died, or is still writing); never loadable. ``"corrupted"``: under a final name but
    damaged, see :attr:`problem`."""

    mtime: float
    """When the checkpoint was completed (its manifest's modification time; the file's for a full one)."""

    global_step: int | None = None
    """The trainer's ``global_step`` at the save, when the checkpoint says so cheaply (None otherwise)."""

    problem: str | None = None
    """For an incomplete or corrupted entry: which file, and what is wrong with it."""

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "path": str(self.path)}


def list_checkpoints(
    directory: str | os.PathLike, *, verify: bool = False, recursive: bool = False
) -> list[CheckpointEntry]:
    """Every checkpoint in ``directory``, newest first.

    Picked up: directories holding a sharded checkpoint (or the remains of one), files ending in ``.ckpt``,
    and the temporaries of unfinished saves (``.NAME.tmp-*``, ``.NAME.old-*``). Anything else (logs, the
    ``.hf`` exports of ``gather_16bit_weights_on_save``, consolidated files) is ignored. A missing
    directory holds no checkpoints.

    ``recursive=True`` also lists the checkpoints in every folder below (a run's ``logs/version_*/checkpoints``,
    a ``ModelCheckpoint``'s ``dirpath``): what a user means by "the checkpoints of this run". A sharded checkpoint
    is a directory too, but it is one entry, never searched as a folder; hidden folders and symbolic links to
    folders are not entered (no cycles). Auto-resume lists one ``ModelCheckpoint`` directory, not recursively.

    ``verify=False`` reads only the manifests, sizes and ``meta.pt`` files (fast enough to run at every
    start); ``verify=True`` also checks every byte against its CRC-32.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    entries = []
    for path in directory.iterdir():
        entry = _entry(path, verify)
        if entry is not None:
            entries.append(entry)
        elif recursive and path.is_dir() and not path.is_symlink() and not path.name.startswith("."):
            entries += list_checkpoints(path, verify=verify, recursive=True)
    return sorted(entries, key=lambda e: (e.mtime, e.global_step or 0, e.path.name), reverse=True)


def _entry(path: Path, verify: bool) -> CheckpointEntry | None:
    """``path``'s entry when it is a checkpoint (or the temporary of one), else None."""
    temporary = parse_temporary(path.name)
    if temporary is not None:
        return _temporary_entry(path, *temporary)
    if path.name.startswith("."):
        return None
    if (path.is_dir() and looks_sharded(path)) or (path.is_file() and path.name.endswith(FULL_SUFFIX)):
        return inspect_checkpoint(path, verify=verify)
    return None


def looks_sharded(path: Path) -> bool:
    """Whether the directory ``path`` is (or was meant to be) a sharded checkpoint."""
    names = (MANIFEST_FILE, DCP_METADATA_FILE, META_FILE)
    return any((path / name).exists() for name in names) or any(path.glob("*.distcp"))


def inspect_checkpoint(path: str | os.PathLike, *, verify: bool = False) -> CheckpointEntry:
    """The :class:`CheckpointEntry` of one checkpoint path (see :func:`list_checkpoints`)."""
    path = Path(path)
    temporary = parse_temporary(path.name)
    if temporary is not None:
        return _temporary_entry(path, *temporary)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    kind: CheckpointKind = "sharded" if path.is_dir() else "full"
    mtime = _mtime(path / MANIFEST_FILE if kind == "sharded" else path) or _mtime(path)
    try:
        step = _check_sharded(path, verify) if kind == "sharded" else _check_full(path, verify)
    except CheckpointError as err:
        return CheckpointEntry(path, kind, "corrupted", mtime, None, str(err))
    return CheckpointEntry(path, kind, "complete", mtime, step)


def _check_sharded(path: Path, verify: bool) -> int | None:
    verify_files(path, checksums=verify)
    if verify:
        read_dcp_metadata(path / DCP_METADATA_FILE)
    return _global_step(read_checkpoint_dict(path / META_FILE))


def _check_full(path: Path, verify: bool) -> int | None:
    verify_archive(path, records=None if verify else ())
    return _global_step(read_checkpoint_dict(path, mmap=True))


def _global_step(meta: dict) -> int | None:
    step = meta.get("global_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _temporary_entry(path: Path, name: str, kind: str) -> CheckpointEntry:
    final = path.with_name(name)
    if kind == "tmp":
        problem = f"a save of {name} that did not finish (its writer died, or is still writing)"
    elif final.exists():
        problem = f"the previous {name}, left behind by a save that was interrupted while removing it"
    else:
        problem = (
            f"the previous {name}, moved aside by a save that was interrupted before it put the new one in place; "
            f"the next save of {name} or the next run start moves it back"
        )
    return CheckpointEntry(path, "sharded" if path.is_dir() else "full", "incomplete", _mtime(path), None, problem)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
