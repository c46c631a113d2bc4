"""Where a checkpoint's bytes go on disk: temporary names, durable writes, atomic replacement, cleanup.

A checkpoint appears under its final name only when it is whole. Every save writes beside it first:

* ``.{name}.tmp-{8 hex}``: what a save is writing (a directory for a sharded save, a file for a full one);
  renamed to ``{name}`` once every file is written, synced and (sharded) listed in ``manifest.json``;
* ``.{name}.old-{8 hex}``: the previous ``{name}``, moved aside for the instant between the two renames of
  :func:`replace` and removed right after.

A process killed at any point therefore leaves ``{name}`` as it was before the save, plus temporaries. Those
are what :func:`remove_temporaries` (before the next save of that path) and :func:`clean_directory` (when a
run starts) remove. One case needs care: killed between the two renames, ``{name}`` is missing and the
``.old-`` sibling is the only copy of the previous checkpoint. Cleanup then moves it back instead of
deleting it; it never deletes anything but a temporary.

Temporaries of a save that is still running (another job writing into the same directory) look the same
as a dead writer's: a run owns its checkpoint directories, as with Lightning's ``ModelCheckpoint``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal

import torch

#: ``.{name}.tmp-{8 hex}`` / ``.{name}.old-{8 hex}``: the final name, and which kind of temporary.
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<tag>[0-9a-f]{8})$")

TemporaryKind = Literal["tmp", "old"]

log = logging.getLogger(__name__)


def temporary_path(path: Path, kind: TemporaryKind = "tmp") -> Path:
    """A fresh temporary sibling of ``path`` (a random tag, so concurrent or repeated saves never collide)."""
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:8]}")


def parse_temporary(name: str) -> tuple[str, TemporaryKind] | None:
    """``(final name, "tmp" | "old")`` when ``name`` is one of our temporaries, else None."""
    match = TEMPORARY.match(name)
    return (match["name"], match["kind"]) if match else None  # type: ignore[return-value]


def temporaries_of(path: Path) -> Iterator[tuple[Path, TemporaryKind]]:
    """The temporaries a save of ``path`` leaves when it is interrupted."""
    if not path.parent.is_dir():
        return
    for entry in path.parent.glob(f".{glob_escape(path.name)}.*-*"):
        parsed = parse_temporary(entry.name)
        if parsed is not None and parsed[0] == path.name:
            yield entry, parsed[1]


def glob_escape(name: str) -> str:
    """Checkpoint names hold ``[`` and ``=`` (``epoch=3-step=[...]``); glob must read them literally."""
    return re.sub(r"([\[\]*?])", r"[\1]", name)


# ---------------------------------------------------------------------- durable writes
def fsync_directory(directory: Path) -> None:
    """Make a rename or a new entry in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and platforms) do not sync directories; the data itself is synced
    finally:
        os.close(fd)


def write_durably(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create ``path`` with ``write(file)``, flushed and synced before returning.

    Writing through a Python file object (rather than handing torch a path) matters for errors: torch's C++
    writer reports a full disk as ``basic_ios::clear: iostream error``; through a Python file the
    ``OSError`` with its errno (ENOSPC, EFBIG, EDQUOT) reaches the caller.
    """
    with open(path, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def save_torch(obj: object, path: Path) -> None:
    """``torch.save(obj, path)``, durable and with errors that keep their errno (see :func:`write_durably`)."""
    write_durably(path, lambda file: torch.save(obj, file))


# ---------------------------------------------------------------------- replace and remove
def replace(new: Path, final: Path) -> None:
    """Move ``new`` (a file or directory) to ``final``, replacing what was there.

    Directories cannot be renamed over one another, so an existing ``final`` is first moved aside to a
    ``.old-`` sibling and removed after; a kill between the two renames is repaired by
    :func:`remove_temporaries`.
    """
    old = None
    if final.is_dir() or (final.exists() and new.is_dir()):
        old = temporary_path(final, "old")
        os.replace(final, old)
    try:
        os.replace(new, final)  # a file over a file: one atomic rename
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    fsync_directory(final.parent)
    if old is not None:
        remove(old)


def remove(path: Path) -> None:
    """Remove a file or a directory tree, if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_temporaries(path: Path) -> list[Path]:
    """Remove what interrupted saves of ``path`` left beside it; returns what was removed.

    A ``.old-`` sibling while ``path`` itself is missing is the previous checkpoint, moved aside by a save
    killed between its two renames: it is moved back to ``path`` (the newest one, if several), not removed.
    """
    removed = []
    olds = []
    for entry, kind in temporaries_of(path):
        if kind == "old":
            olds.append(entry)
        else:
            remove(entry)
            removed.append(entry)
    if olds and not path.exists():
        newest = max(olds, key=_mtime)
        os.replace(newest, path)
        fsync_directory(path.parent)
        olds.remove(newest)
        log.warning("Restored %s from %s: a save was interrupted after moving it aside.", path, newest.name)
    for entry in olds:
        remove(entry)
        removed.append(entry)
    if removed:
        log.info("Removed what interrupted saves of %s left: %s", path, ", ".join(p.name for p in removed))
    return removed


def clean_directory(directory: Path) -> list[Path]:
    """:func:`remove_temporaries` for every checkpoint name with temporaries in ``directory``."""
    if not directory.is_dir():
        return []
    names = {parsed[0] for entry in directory.iterdir() if (parsed := parse_temporary(entry.name))}
    return [entry for name in sorted(names) for entry in remove_temporaries(directory / name)]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
