"""Asynchronous sharded saves (``ZeroStrategy(async_save=True)``): training goes on while shards are written.

A save blocks the training loop only for:

1. waiting for the previous asynchronous save (usually long finished), and learning its outcome;
2. staging: copying this rank's shards (model rows, optimizer state) into host buffers of its own;
3. the first step of the save protocol (``write.prepare``): the temporary's name, ``meta.pt``.

Then ``torch.distributed.checkpoint.async_save`` writes the staged copy from a background thread, and a
second background step checksums the files, writes the manifest with every rank's CRC-32s and renames the
temporary to the final name (``write.publish``). Until that rename the previous checkpoint under
the same name is untouched, so a crash at any point of an asynchronous save leaves it and temporaries only.

[Note: staging ourselves]
DCP's default stager (torch 2.13) cannot be used: on the CPU it fails on the dim-0 sharded DTensors every
checkpoint holds ("Attempted to call copy_() on an invalid python storage"), and for a plain tensor that is
a view (a shard of a flat buffer) it copies the view's whole storage. We copy exactly each shard, wrap it
in a DTensor of the same mesh and placements, and hand DCP a stager that passes the copy through. Buffers
are kept and reused by the next save, as DCP's own ``cache_staged_state_dict`` does: an asynchronous save
costs one host copy of this rank's shards, for the whole run.

[Note: a process group of its own]
DCP's collectives (planning, gathering write results) and ours (checksums, the rename) run in the
background thread while the training loop issues its own collectives. On one process group they would
interleave differently on different ranks; they run on a dedicated group created on every rank in
``setup`` instead. Ranks finish a save together (its last step is collective), so every rank learns the
same outcome; a removal Lightning asks for meanwhile (``save_top_k``) waits for that outcome and is dropped
if the save failed (the old checkpoint is then the newest one there is).
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint.errors import CheckpointSaveError, save_error
from lightning_zero.checkpoint.files import remove
from lightning_zero.checkpoint.write import ShardWriter, prepare, publish, split_checkpoint
from lightning_zero.engine.comm import collectives, topology
from lightning_zero.torch_versions.dtensor import dtensor_over

log = logging.getLogger(__name__)


def checkpoint_group(timeout: timedelta):
    """The dedicated process group of asynchronous saves (collective on first use in a world group)."""
    return topology.new_group("asynchronous checkpoints", timeout=timeout)


class _AlreadyStaged(AsyncStager):
    """Hands DCP the copy :class:`Stager` made (see [Note: staging ourselves])."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class Stager:
    """Copies a checkpoint's tensors into host buffers that the training loop never touches."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def stage(self, tree: Any, key: tuple = ()) -> Any:
        if isinstance(tree, DTensor):
            local = self._copy(tree.to_local(), key)
            return dtensor_over(local, tree.device_mesh, tree.placements, tree.shape, tree.stride())
        if isinstance(tree, torch.Tensor):
            return self._copy(tree, key)
        if isinstance(tree, dict):
            return {k: self.stage(v, (*key, k)) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.stage(v, (*key, i)) for i, v in enumerate(tree))
        return copy.deepcopy(tree)  # e.g. a module's extra state: it may change in place too

    def _copy(self, tensor: torch.Tensor, key: tuple) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            self._buffers[key] = buffer
        return buffer.copy_(tensor.detach())


class _Pending:
    """One asynchronous save in flight."""

    def __init__(self, path: Path, tmp: Path, previous: bool, step: Any) -> None:
        self.path, self.tmp, self.previous, self.step = path, tmp, previous, step
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.abandoned = False  # the main thread stopped waiting: do not rename
        self.succeeded: bool | None = None  # set under `lock` once known: removals wait for it
        self.removals: list[Path] = []
        self.lock = threading.Lock()


class AsyncSaver:
    """One rank's asynchronous checkpoint writer. Every method is collective unless it says otherwise."""

    def __init__(self, group, timeout: timedelta) -> None:
        self.group = group
        self.timeout = timeout
        self._stager = Stager()
        self._pending: _Pending | None = None

    @property
    def pending(self) -> Path | None:
        """The path being written, if a save is in flight (rank-local)."""
        return self._pending.path if self._pending is not None else None

    def save(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Start saving ``checkpoint`` (a sharded one) to ``path``; returns once it is staged."""
        self.wait()
        tensors, meta = split_checkpoint(checkpoint)
        staged = self._stager.stage(tensors)
        tmp, previous = prepare(path, meta)
        pending = _Pending(path, tmp, previous, meta.get("global_step"))
        try:
            upload = dcp.async_save(
                staged, storage_writer=ShardWriter(tmp), process_group=self.group, async_stager=_AlreadyStaged()
            )
        except BaseException:
            if collectives.rank() == 0:
                remove(tmp)
            raise
        # A daemon thread: a finisher stuck on a dead peer (bounded by the group's timeout) never holds up exit.
        finisher = threading.Thread(
            target=self._run_finish, args=(pending, upload), name="lightning_zero-save", daemon=True
        )
        finisher.start()
        self._pending = pending

    def _run_finish(self, pending: _Pending, upload: concurrent.futures.Future) -> None:
        try:
            self._finish(pending, upload)
        except BaseException as err:  # handed to whoever waits for this save
            pending.done.set_exception(err)
        else:
            pending.done.set_result(None)

    def _finish(self, pending: _Pending, upload: concurrent.futures.Future) -> None:
        """Background thread: wait for DCP's write, then publish (checksums, manifest, rename)."""
        try:
            try:
                upload.result()
            except CheckpointException as err:  # raised alike on every rank
                failures = {rank: (f[0] if isinstance(f, tuple) else f) for rank, f in err.failures.items()}
                raise save_error(pending.path, failures, pending.previous) from None
            publish(pending.tmp, pending.path, pending.previous, self.group, before_rename=lambda: _check(pending))
        except BaseException:
            with pending.lock:
                pending.succeeded = False
            if collectives.rank(self.group) == 0:
                remove(pending.tmp)
            raise
        with pending.lock:
            pending.succeeded = True
            removals = list(pending.removals)
        for path in removals:
            remove(path)

    def remove(self, path: Path) -> None:
        """Rank-local (rank 0): remove ``path`` now, or after the save in flight has succeeded."""
        pending = self._pending
        if pending is not None:
            with pending.lock:
                if pending.succeeded is not True:
                    # In flight: removed once it succeeds. Failed: kept, as the newest checkpoint there is (the
                    # failure is raised at the next save or at teardown, naming what was kept).
                    pending.removals.append(path)
                    return
        remove(path)

    def wait(self, *, agree: bool = True) -> None:
        """Wait for the save in flight and raise its failure on every rank. Bounded: if its files stop growing
        for ``timeout`` (a writer or a peer it waits for is stuck), the save is abandoned and that is the error.

        ``agree=False`` (the run already failed; peers may be gone): rank-local, logs a failure instead.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error: BaseException | None = None
        try:
            _wait_while_progressing(pending, self.timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            pending.abandoned = True  # it will not be renamed into place if it finishes after all
            kept = f"the previous checkpoint at {pending.path} is intact" if pending.previous else "nothing was written"
            error = CheckpointSaveError(
                f"The asynchronous save of {pending.path} (step {pending.step}) made no progress for "
                f"timeout={self.timeout.total_seconds():g}s while rank {collectives.rank()} waited for it (its files "
                f"in {pending.tmp.name} stopped growing): a writer, or a peer rank it waits for, is stuck. The save "
                f"was abandoned; {kept}."
            )
        except Exception as err:
            error = err
        with pending.lock:
            kept = ", ".join(str(p) for p in pending.removals) if not pending.succeeded else ""
        if error is not None and kept:
            error = CheckpointSaveError(f"{error}\nKept {kept}, which the run asked to remove after this save.")
        if not agree:
            if error is not None:
                log.error("lightning_zero: %s", error)
            return
        messages = collectives.all_gather_objects(None if error is None else str(error))
        failed = [m for m in messages if m is not None]
        if failed:
            raise error if isinstance(error, CheckpointSaveError) else CheckpointSaveError(failed[0])

    def close(self, *, agree: bool = True) -> None:
        """Wait for the save in flight (see :meth:`wait`); the saver is not used after."""
        self.wait(agree=agree)
        self._stager = Stager()  # the staging buffers go with the run


def _wait_while_progressing(pending: _Pending, timeout: float) -> None:
    """``pending.done.result()``, raising ``TimeoutError`` only after ``timeout`` seconds in which the bytes
    in its temporary directory (every rank's files: a shared filesystem) did not change. A large checkpoint on
    slow storage may take longer than ``timeout`` to write; it is stuck only when it stops moving."""
    last, since = _progress(pending.tmp), time.monotonic()
    while True:
        try:
            return pending.done.result(timeout=min(1.0, timeout))
        except concurrent.futures.TimeoutError:
            now, progress = time.monotonic(), _progress(pending.tmp)
            if progress != last:
                last, since = progress, now
            elif now - since >= timeout:
                raise


def _progress(directory: Path) -> tuple[int, int] | None:
    """(files, bytes) in ``directory``, or None once it is gone (renamed into place, or removed)."""
    try:
        sizes = [entry.stat().st_size for entry in os.scandir(directory) if entry.is_file()]
    except OSError:
        return None
    return len(sizes), sum(sizes)


def _check(pending: _Pending) -> None:
    if pending.abandoned:
        raise CheckpointSaveError(f"the main thread stopped waiting for the save of {pending.path} (timeout)")
