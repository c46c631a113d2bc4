"""Reading checkpoint files without the possibility of executing code.

A checkpoint directory is data that other people write: team storage, a downloaded fine-tune. Its
``manifest.json`` is a checksum, not a signature, so anyone who can replace a file can update the manifest
too. Every reader of this package therefore goes through here:

* ``.metadata`` of a ``torch.distributed.checkpoint`` directory is a pickle that DCP's ``FileSystemReader``
  loads with plain ``pickle``. :class:`SafeFileSystemReader` loads it with :class:`MetadataUnpickler`, which
  resolves only the plain data classes DCP writes there (and nothing that can call out to the system);
* non-tensor entries inside the shard files are ``torch.save`` blobs that DCP's ``DefaultLoadPlanner`` reads
  with ``torch.load(weights_only=False)``; :class:`SafeLoadPlanner` reads them with ``weights_only=True``;
* ``torch.save`` files (``meta.pt``, full checkpoints, consolidated files, pretrained weights) go through
  :func:`load_weights_only`, torch's own restricted unpickler.

Anything else is refused with an :class:`UnsafeCheckpointError` that names the file and the type it met.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lightning_zero.checkpoint.verify import CheckpointError
from lightning_zero.torch_versions.dcp import set_nested

_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch": {"Size"},
    # Maps a layout's name (a string in the file) to the layout object; calls nothing else.
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something that reading it could execute; it was refused, not run."""


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata: only the data classes DCP writes, torch dtypes and sizes resolve.

    The pure-Python unpickler, not the C one: the C unpickler grows its memo array to whatever index a
    ``LONG_BINPUT`` names, so one damaged or crafted byte asks for gigabytes (found by the corruption fuzz:
    a 13 KB file held the machine for a minute). The Python one keeps its memo in a dict. It parses slower
    (``benchmarks/results/2026-12-07-docstring-figures.md``); :func:`read_dcp_metadata` caches the result, so
    a load parses each file once.
    """

    def __init__(self, file, path: str | os.PathLike) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"Refused to read {self.path}: it references `{module}.{name}`, which is not one of the data types "
            "a torch.distributed.checkpoint metadata file holds. The file was tampered with or is not a "
            "checkpoint; nothing in it was executed."
        )


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The ``Metadata`` object of the DCP file ``path`` (a ``.metadata`` file), read without executing code.

    Cached per version of the file (its inode, size and modification time): one load reads it several times
    (shape checks, DCP's reader), and ``consolidate`` once per tensor. Callers must not modify the result.
    """
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if (cached := _METADATA_CACHE.get(key)) is not None:
        return cached
    with open(path, "rb") as file:
        data = io.BytesIO(file.read())  # in memory: a damaged length field cannot make a read allocate it
    try:
        metadata = MetadataUnpickler(data, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated or garbage bytes: say which file
        raise CheckpointError(f"Cannot read {path}: it is not a valid checkpoint metadata file ({err!r}).") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"Refused {path}: it holds a {type(metadata).__name__}, not checkpoint metadata.")
    while len(_METADATA_CACHE) >= 4:
        _METADATA_CACHE.pop(next(iter(_METADATA_CACHE)))
    _METADATA_CACHE[key] = metadata
    return metadata


_METADATA_CACHE: dict[tuple, Metadata] = {}


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` in place of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = copy.copy(read_dcp_metadata(path))  # the cached object stays as read
        metadata.storage_meta = dataclasses.replace(metadata.storage_meta or StorageMeta(), load_id=self.load_id)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def __init__(self, *args: Any, path: str | os.PathLike = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = path

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_weights_only(value, what=f"entry {fqn!r} of {self.path}")
        if self.flatten_state_dict:
            set_nested(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_weights_only(source: str | os.PathLike | io.BytesIO, *, what: str | None = None, **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True)``, with a refusal that names the file and the type it met."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        # torch's message opens with advice to retry with weights_only=False; keep only what it refused.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        refused = ("GLOBAL", "WeightsUnpickler error", "Unsupported")
        detail = next((line for line in lines if any(word in line for word in refused)), lines[-1] if lines else "")
        raise UnsafeCheckpointError(
            f"Refused to read {what or source}: {detail} torch's weights-only loader allows tensors and plain "
            "Python data only; nothing in the file was executed. If you trust a type it needs, allow it with "
            "`torch.serialization.add_safe_globals([...])`."
        ) from None


def dcp_load(
    state: dict,
    path: Path,
    *,
    allow_partial_load: bool = False,
    no_dist: bool = False,
    planner: SafeLoadPlanner | None = None,
) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``path`` through the safe reader and planner (or
    ``planner``, one that reads as safely)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_dcp_metadata(Path(path) / ".metadata")  # refused here, on every rank, rather than inside DCP's gather
    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path),
            planner=planner or SafeLoadPlanner(allow_partial_load=allow_partial_load, path=path),
            no_dist=no_dist,
        )
    except CheckpointException as err:  # DCP wraps each rank's failure: surface ours as it was raised
        causes = {rank: failure[0] if isinstance(failure, tuple) else failure for rank, failure in err.failures.items()}
        for cause in causes.values():
            if isinstance(cause, CheckpointError):
                raise cause from None
        # Anything else (a BaseException in torch) is a shard DCP could not read: name the checkpoint.
        rank, cause = min(causes.items())
        raise CheckpointError(
            f"Cannot read the checkpoint {path}: its .metadata or a shard file is damaged (rank {rank}: "
            f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''})."
        ) from None


def dcp_load_here(state: dict, path: Path, planner: SafeLoadPlanner | None = None) -> None:
    """:func:`dcp_load` in this one process. ``no_dist=True`` is DCP's way to say so, yet torch still warns that
    distributed is "disabled, unavailable or uninitialized" on every call: that one warning, which here is the
    intent rather than a problem, is silenced; any other is left alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
        )
        dcp_load(state, path, no_dist=True, planner=planner)
