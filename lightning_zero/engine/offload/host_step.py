"""One call of the host step: the sequence every offloaded step runs, whichever thread and schedule run it
(``schedule.py``), at every stage.

It waits for the copies that bring the part's gradients to the host, averages them where the worker does
(a part stepped during backward), stands the masters in for the parameters (see [Note: re-hosting without replacing
the optimizer] in ``stage12/sharded_optimizer.py``), and steps with torch's fused CPU kernel where the user chose
none (:func:`host_kernel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.engine.optimizers import Standins, hosted_params
from lightning_zero.engine.state_dtype import StateDtype

#: Optimizers with a fused CPU kernel in torch (``fused=True``), much faster on host shards than the per-tensor loop
#: torch picks for CPU tensors by default (``docs/offload.md``).
FUSED_ON_CPU: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("Adam", "AdamW", "SGD", "Adagrad") if hasattr(torch.optim, name)
)
#: Those whose fused kernel DTensor can run (stage 3 ``offload_params`` steps FSDP2's DTensor shards directly):
#: ``_fused_sgd_`` and ``_fused_adagrad_`` have no sharding strategy registered.
FUSED_ON_DTENSOR: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


@contextlib.contextmanager
def host_kernel(optimizer: Optimizer, enabled: bool = True) -> Iterator[None]:
    """Use torch's fused CPU kernel for the param groups where the user left ``fused`` and ``foreach`` unset. The
    settings are restored afterwards so checkpoints and ``state_dict`` show the user's own values."""
    if not enabled or not isinstance(optimizer, FUSED_ON_CPU):
        yield
        return
    dtensor_ok = isinstance(optimizer, FUSED_ON_DTENSOR)
    chosen = [
        group
        for group in optimizer.param_groups
        if "fused" in group
        and group["fused"] is None
        and group.get("foreach") is None
        and not group.get("differentiable")
        and (dtensor_ok or not any(isinstance(p, DTensor) for p in group["params"]))
        and all(p.is_floating_point() for p in group["params"])  # torch's fused kernels refuse complex tensors
    ]
    for group in chosen:
        group["fused"] = True
    try:
        yield
    finally:
        for group in chosen:
            group["fused"] = None


def step_on_host(
    optimizer: Optimizer,
    standins: Mapping[int, tuple[torch.Tensor, torch.Tensor | None] | None] | Standins,
    *,
    after: torch.Event | None = None,
    average: tuple[list[torch.Tensor], float] | None = None,
    kernel: bool = True,
    states: StateDtype | None = None,
    before: Callable[[], None] | None = None,
    inner: Callable[[Optimizer], contextlib.AbstractContextManager[None]] | None = None,
    **kwargs: Any,
) -> object:
    """Step ``optimizer`` on ``standins`` (``optimizers.hosted_params``) once the copies behind ``after`` are done;
    ``average``: gradients to scale by a coefficient first; ``kernel``: choose the fused CPU kernel (off where the
    tensors are not on the host); ``states``: the dtype its state is held in between steps; ``before``: called with
    the gradients final, before the step writes anything (``speculation.py``); ``inner``: a re-hosting entered inside
    the stand-ins' (stage 3's local shards, for parameters stepped in place on the host)."""
    if after is not None:
        after.synchronize()
    if average is not None and average[0] and average[1] != 1.0:
        torch._foreach_mul_(*average)
    if before is not None:
        before()
    with (
        hosted_params(optimizer, standins),
        inner(optimizer) if inner is not None else contextlib.nullcontext(),
        host_kernel(optimizer, enabled=kernel),
    ):
        return states.step(optimizer, **kwargs) if states is not None else optimizer.step(**kwargs)
