"""Counting the bytes of tensors a process holds, from outside any strategy.

The count walks every live tensor the garbage collector knows, counts each storage once (views of one flat
buffer share it), counts a DTensor by its local shard, and skips freed storages (FSDP2 resizes gathered
parameters to zero bytes). It sees whatever a strategy keeps, wherever it keeps it.

:func:`model_state_bytes` instead asks a ZeroStrategy engine what it holds, so model state can be split by
kind and by placement (device or host memory) even where both are the same memory (a CPU-only run).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.engine.api import ShardingEngine


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage; a DTensor's local shard; (0, 0) when there is none."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if local.is_meta:  # a meta tensor has a size but no storage
        return 0, 0
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
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


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[Optimizer], engine: ShardingEngine | None = None
) -> dict[str, int]:
    """Bytes of model state this rank holds (each storage once): by kind (``params``, ``grads``,
    ``masters``, ``optimizer``) and by placement (``device``, ``host``), the terms of the ZeRO formulas.

    Placement is where the engine put a tensor: with ``offload_optimizer`` the masters, their gradient
    buffers and the optimizer state are host memory (with a share ``r``, those of the parameters offloaded);
    with ``offload_params`` the parameter shards and their gradients too. On an accelerator this is the tensors' device type; on a CPU-only run, where host and
    device are one memory, it is the only way to tell them apart.
    """
    gathered = engine.gathered_units if engine is not None else None
    params_on_host = gathered is not None and gathered.params_on_host
    out = dict.fromkeys(("params", "grads", "masters", "optimizer", "device", "host"), 0)
    seen: set[int] = set()

    def add(kind: str, tensor: torch.Tensor, on_host: bool) -> None:
        ptr, size = _storage(tensor)
        if size == 0 or ptr in seen:
            return
        seen.add(ptr)
        out[kind] += size
        out["host" if on_host else "device"] += size

    for p in module.parameters():
        add("params", p, params_on_host)
        if p.grad is not None:
            add("grads", p.grad, params_on_host)
    for kind, tensor, on_host in engine.state_tensors() if engine is not None else ():
        add(kind, tensor, on_host)
    for optimizer in optimizers:
        if engine is not None:  # a host step in the worker may be creating this state: read it once it is done
            engine.optimizer_shards(optimizer).settle()
        for key, state in optimizer.state.items():
            on_host = engine is not None and engine.on_host(key)  # partial offload: per tensor
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add("optimizer", value, on_host)
    return out
