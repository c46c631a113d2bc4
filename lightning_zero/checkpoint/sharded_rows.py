"""The model weights of a sharded checkpoint directory, read a rank's rows at a time: ``init_weights=`` takes a
directory ZeroStrategy wrote (any stage and world size) as it takes a ``save_pretrained`` directory.

A tensor was saved as every writer's rows; the rows a reader wants overlap some of them. DCP plans that overlap
itself when asked for a chunk (``create_read_items_for_chunk_list``), so :class:`_RowsPlanner` asks for exactly
the reader's rows, and only the shard files holding them are read. Metadata is read through ``safe_load.py``, so
nothing in the directory is unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_zero.checkpoint.safe_load import SafeLoadPlanner, dcp_load_here, read_dcp_metadata
from lightning_zero.checkpoint.verify import check_complete

PREFIX = "state_dict."


def is_sharded_directory(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


class ShardedWeights:
    """The ``state_dict`` tensors of a sharded checkpoint by name, with safetensors' ``keys``/``get_slice``."""

    def __init__(self, path: Path) -> None:
        check_complete(path)
        self.path = path
        metadata = read_dcp_metadata(path / ".metadata").state_dict_metadata
        self._items = {
            key[len(PREFIX) :]: item
            for key, item in metadata.items()
            if key.startswith(PREFIX) and isinstance(item, TensorStorageMetadata)
        }

    def keys(self) -> list[str]:
        return list(self._items)

    def get_slice(self, key: str) -> _Rows:
        return _Rows(self.path, PREFIX + key, self._items[key])


class _Rows:
    """One saved tensor: its shape, and ``[start:end]`` (dim-0 rows) or ``[...]`` (whole) read from the shards."""

    def __init__(self, path: Path, key: str, item: TensorStorageMetadata) -> None:
        self.path, self.key, self.item = path, key, item

    def get_shape(self) -> list[int]:
        return list(self.item.size)

    def __getitem__(self, index: Any) -> torch.Tensor:
        size = self.item.size
        if index is Ellipsis or not size:
            start, end = 0, size[0] if size else 0
        elif isinstance(index, slice) and index.step in (None, 1):
            start, end, _ = index.indices(size[0])
        else:
            raise TypeError(f"rows of {self.key} are read as [start:end] or [...], not {index!r}")
        rows = torch.empty((max(end - start, 0), *size[1:]) if size else (), dtype=self.item.properties.dtype)
        if rows.numel():
            _read(self.path, self.key, rows, start)
        return rows


class _RowsPlanner(SafeLoadPlanner):
    """Reads one tensor's rows from ``start`` into the buffer the state dict holds under its key."""

    def __init__(self, key: str, start: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key, self.start = key, start

    def create_local_plan(self) -> LoadPlan:
        item = self.metadata.state_dict_metadata[self.key]  # type: ignore[union-attr]
        rows = self.state_dict[self.key]
        offsets = torch.Size([self.start] + [0] * (rows.dim() - 1)) if rows.dim() else torch.Size([])
        wanted = ChunkStorageMetadata(offsets=offsets, sizes=rows.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.key, item, [wanted]))  # type: ignore[arg-type]

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The rows buffer: read items address it by the rows' offset in the whole tensor, which a plain tensor
        does not carry (DCP looks such offsets up in sharded tensors only); their ``dest_offsets`` are relative
        to it."""
        return self.state_dict[index.fqn]


def _read(path: Path, key: str, rows: torch.Tensor, start: int) -> None:
    dcp_load_here({key: rows}, path, _RowsPlanner(key, start, path=path))
