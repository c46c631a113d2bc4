"""Failures of checkpoint I/O: what the user is told, and how every rank learns of a failure on one.

A save is a sequence of collectives with rank-local file writes in between. If one rank's write fails and
it simply raised, its peers would wait in the next collective for a rank that never comes (and on NCCL
wait until the process-group timeout). :func:`on_every_rank` therefore closes every rank-local part
of a save: each rank's result or failure, or None, is all-gathered, and every rank raises the same error naming the
rank(s) that failed.

Disk-full failures are recognised by their errno (ENOSPC, EFBIG from a file-size limit, EDQUOT) anywhere in
the exception chain; torch's own messages for them (``unexpected pos``, ``basic_ios::clear``) say nothing
of the cause. :func:`with_errno` keeps the errno of a failure across ranks (DCP pickles each rank's exception
to the coordinator, which drops ``__context__``), so it runs on the failing rank, before the gather.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar, cast

from lightning_zero.engine.comm import collectives

T = TypeVar("T")

#: errnos that mean "no room for the checkpoint": the disk, a file-size limit, a quota.
DISK_FULL = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written. Raised on every rank; the message names the rank(s) that failed,
    and the previous checkpoint under the same name (if any) is intact."""


def os_error_in(exception: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``exception``'s chain (``__cause__`` / ``__context__``)."""
    seen = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        current = current.__cause__ or current.__context__
    return None


def with_errno(exception: BaseException, doing: str | None) -> OSError | None:
    """The failure as it should cross ranks when an errno is behind it: an ``OSError`` with that errno, its
    text and the file (these survive pickling, the exception chain does not); None otherwise. ``doing``
    names the file when the error does not, e.g. ``"a shard file in /ckpt/.last.ckpt.tmp-1a2b3c4d"``."""
    found = os_error_in(exception)
    if found is None or found.errno is None:
        return None
    return OSError(found.errno, found.strerror or os.strerror(found.errno), found.filename or doing or None)


def reraise(exception: Exception, doing: str | None) -> None:
    """Re-raise ``exception`` (from an ``except`` block), as :func:`with_errno`'s ``OSError`` if it has one."""
    translated = with_errno(exception, doing)
    if translated is None:
        raise exception
    raise translated from exception


def is_disk_full(exception: BaseException) -> bool:
    found = os_error_in(exception)
    return found is not None and found.errno in DISK_FULL


def save_error(path: Path, failures: Mapping[int, BaseException | str], previous: bool) -> CheckpointSaveError:
    """The error every rank raises when saving ``path`` failed on the ranks in ``failures``."""
    ranks = sorted(failures)
    which = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    lines = [f"Saving the checkpoint {path} failed on {which}."]
    disk_full = False
    for rank in ranks:
        failure = failures[rank]
        text = failure if isinstance(failure, str) else _one_line(failure)
        disk_full = disk_full or (not isinstance(failure, str) and is_disk_full(failure)) or _mentions_disk_full(text)
        lines.append(f"  rank {rank}: {text}")
    if disk_full:
        lines.append("The disk may be full (or a file-size limit or quota was reached): free space or save elsewhere.")
    kept = f"the previous checkpoint at {path} is intact" if previous else f"nothing was written under {path}"
    lines.append(f"The partial files of this save were removed; {kept}.")
    return CheckpointSaveError("\n".join(lines))


def _one_line(exception: BaseException) -> str:
    if isinstance(exception, OSError) and exception.errno is not None:
        where = f" ({exception.filename})" if exception.filename else ""
        return f"[Errno {exception.errno}] {exception.strerror}{where}"
    text = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {text[0] if text else ''}".rstrip(": ")


def _mentions_disk_full(text: str) -> bool:
    return any(os.strerror(code) in text for code in DISK_FULL)


def on_every_rank(step: Callable[[], T], make_error: Callable[[dict], BaseException], group=None) -> list[T]:
    """Run the rank-local ``step``; then every rank gets every rank's result, in rank order, or every rank
    raises ``make_error({rank: failure})`` if ``step`` failed on any rank.

    Collective over ``group``: every rank must call it at the same point (``step`` may do nothing on some
    ranks). The all-gather doubles as the barrier a save needs at these points anyway.
    """
    outcome: tuple[bool, T | BaseException | str]
    try:
        outcome = (True, step())
    except Exception as err:  # gathered, then raised on every rank below
        outcome = (False, _portable(with_errno(err, None) or err))
    gathered = collectives.all_gather_objects(outcome, group=group)
    failures = {rank: value for rank, (ok, value) in enumerate(gathered) if not ok}
    if failures:
        raise make_error(failures)
    return [cast(T, value) for _, value in gathered]  # every rank's step succeeded


def _portable(failure: BaseException) -> BaseException | str:
    """An exception that crosses ranks intact if it pickles (OSError keeps its errno); else its text."""
    if isinstance(failure, OSError):
        return failure
    return _one_line(failure)
