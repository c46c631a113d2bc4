"""Bringing the whole run down with the error of the rank that failed first.

When one rank raises (say in ``training_step``), its peers are usually blocked inside a collective; with
gloo they get "connection closed by peer" as soon as that rank's process exits, which says nothing about
the cause. The failing rank therefore records its error in the process group's key-value store before it
exits, and every rank that fails afterwards appends the first failure to its own error message.
"""

from __future__ import annotations

import torch.distributed as dist

_KEY = "lightning_zero/first_failure"


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store (e.g. an externally created group without one): nothing to propagate
        return None


def install() -> None:
    """Clear a failure left by an earlier run that shared this store."""
    store = _store()
    if store is not None:
        try:
            store.delete_key(_KEY)
        except Exception:
            pass


def report(exception: BaseException, rank: int) -> None:
    """Record ``exception`` as the first failure, or name the first failure of another rank in it."""
    store = _store()
    if store is None:
        return
    mine = f"rank {rank}: {type(exception).__name__}: {exception}"
    try:
        first = store.compare_set(_KEY, "", mine).decode()
    except Exception:
        return
    same_error = first.partition(": ")[2] == mine.partition(": ")[2]
    if first and not same_error and not first.startswith(f"rank {rank}:"):
        note = f"\n[lightning_zero] the run was brought down by the first failure on {first}"
        if exception.args and isinstance(exception.args[0], str):
            exception.args = (exception.args[0] + note, *exception.args[1:])
        else:
            exception.args = (*exception.args, note)
