"""What every engine needs of the user's optimizer, whichever stage: which optimizers may step shards instead of
whole tensors, and stand-in tensors in ``param_groups`` for the duration of a step (see [Note: re-hosting without
replacing the optimizer] in ``sharded_optimizer.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TypeVar

import torch
from torch.optim import Optimizer

T = TypeVar("T")

#: Optimizers whose update of an element depends only on that element's gradient and state, so stepping
#: each rank's shard separately equals stepping the whole tensor.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD")
    if hasattr(torch.optim, name)
)
#: Optimizers known to couple elements (line searches, factored or matrix-wise statistics, sparse updates).
NON_ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam", "Adafactor", "Muon") if hasattr(torch.optim, name)
)


def shards_of(wrapped: Mapping[int, T], optimizer: Optimizer) -> T:
    """The engine's handle of ``optimizer`` (keyed by ``id``), or an error saying how it came to be missing."""
    try:
        return wrapped[id(optimizer)]
    except KeyError:
        raise RuntimeError(
            f"{type(optimizer).__name__} was not set up by ZeroStrategy; return every optimizer from "
            "`configure_optimizers` so it can be sharded."
        ) from None


def check_elementwise(optimizer: Optimizer, stage: int, extra: tuple[type, ...] = ()) -> None:
    """Refuse optimizers whose sharded step could differ from the unsharded one: known non-element-wise
    ones, and any class neither we nor the user (``elementwise_optimizers=``) vouch for, since per-tensor
    statistics (LAMB's trust ratio, Shampoo's preconditioners) are silently wrong on shards."""
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS + tuple(extra)) and not isinstance(optimizer, NON_ELEMENTWISE_OPTIMIZERS):
        return
    allowed = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise TypeError(
        f"ZeroStrategy(stage={stage}) cannot shard `{type(optimizer).__name__}`: each rank steps only its own "
        f"shard of every parameter, which is exact only for element-wise optimizers. Use one of {allowed} "
        "(or a subclass), or, if your optimizer updates every element independently, pass "
        f"`ZeroStrategy(elementwise_optimizers=({type(optimizer).__name__},))`."
    )


@contextlib.contextmanager
def hosted_params(optimizer: Optimizer, standins: Mapping[int, tuple[torch.Tensor, torch.Tensor | None]]) -> Iterator[None]:
    """For the duration of the block, ``optimizer.param_groups`` holds, in place of each parameter ``p`` with
    ``id(p)`` in ``standins``, the stand-in tensor given for it, its ``.grad`` set to the gradient given."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            hosted = []
            for p in group["params"]:
                standin = standins.get(id(p))
                if standin is None:
                    hosted.append(p)
                    continue
                tensor, grad = standin
                tensor.grad = grad
                hosted.append(tensor)
            group["params"] = hosted
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
        for tensor, _ in standins.values():
            tensor.grad = None
