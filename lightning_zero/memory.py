"""Counting the bytes of tensors a process holds, from outside any strategy.

The count walks every live tensor the garbage collector knows, counts each storage once (views of one flat
buffer share it), counts a DTensor by its local shard, and skips freed storages (FSDP2 resizes gathered
parameters to zero bytes). It sees whatever a strategy keeps, wherever it keeps it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage; a DTensor's local shard; (0, 0) when there is none."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # meta tensors, wrapper subclasses without storage
        return 0, 0


def live_tensor_bytes(device: str | None = None) -> int:
    """Bytes of all live tensor storages (optionally only those on ``device``'s type)."""
    gc.collect()
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            tensor = obj._local_tensor if isinstance(obj, DTensor) else obj
            if tensor.is_meta or (device is not None and tensor.device.type != device):
                continue
        except (RuntimeError, NotImplementedError):
            continue
        ptr, size = _storage(tensor)
        if size == 0 or ptr in seen:
            continue
        seen.add(ptr)
        total += size
    return total


@contextlib.contextmanager
def saved_tensor_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[dict[str, int]]:
    """Count the bytes autograd saves for backward inside the block (each storage once), leaving out the
    storages of ``exclude`` (e.g. the parameters, which are held anyway). Activation checkpointing installs
    its own hooks inside checkpointed modules, so what they drop is not counted: the count is what the
    graph actually keeps."""
    skip = {_storage(t)[0] for t in exclude}
    seen: set[int] = set()
    counter = {"bytes": 0}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr, size = _storage(tensor)
        if size and ptr not in seen and ptr not in skip:
            seen.add(ptr)
            counter["bytes"] += size
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counter
