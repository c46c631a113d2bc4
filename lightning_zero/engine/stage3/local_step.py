"""Stepping an element-wise optimizer on the local tensors of FSDP2's sharded parameters rather than on the
DTensors themselves.

[Note: local-shard step]
An element-wise optimizer updates each element from that element's gradient and state alone, so stepping a rank's local
shard is the same arithmetic as stepping the DTensor: the DTensor only adds dispatch, paid per operator per parameter,
and with hundreds of parameter tensors that is most of stage 3's host time in a step. So for the duration of a step the
optimizer's ``param_groups`` hold the local tensors and its ``state`` holds, under each local tensor, the local tensors
of that parameter's DTensor state. Afterwards any state tensor the step created is wrapped back into a DTensor laid out
like its parameter, so ``optimizer.state`` between steps is exactly what stepping the DTensors would have left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.engine.optimizers import hosted_params
from lightning_zero.torch_versions.dtensor import dtensor_over


@contextlib.contextmanager
def stepping_local_shards(optimizer: Optimizer, params: Sequence[DTensor]) -> Iterator[None]:
    """See [Note: local-shard step]. Enter it inside any other re-hosting of the same optimizer: the parameters here
    must be in its groups."""
    if not params:
        yield
        return
    with torch.no_grad():
        locals_ = [p.to_local() for p in params]
        grads = [None if p.grad is None else local_tensor(p.grad) for p in params]
        state = optimizer.state
        for p, local in zip(params, locals_):
            held = state.get(p)
            if held:
                state[local] = {
                    key: local_tensor(value) if isinstance(value, torch.Tensor) else value
                    for key, value in held.items()
                }
    try:
        with hosted_params(optimizer, {id(p): (local, grad) for p, local, grad in zip(params, locals_, grads)}):
            yield
    finally:
        with torch.no_grad():
            for p, local in zip(params, locals_):
                stepped = state.pop(local, None)
                if stepped:
                    _write_back(state.setdefault(p, {}), stepped, p, local)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _write_back(held: dict[str, object], stepped: dict[str, object], param: DTensor, local: torch.Tensor) -> None:
    """A tensor the step created of the local shard's shape becomes a DTensor laid out like ``param``, as the
    optimizer's ``zeros_like(param)`` would have made it."""
    for key, value in stepped.items():
        old = held.get(key)
        if isinstance(old, DTensor) and old.to_local() is value:
            continue
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
            value = dtensor_over(value, param.device_mesh, param.placements, param.shape, param.stride())
        held[key] = value
