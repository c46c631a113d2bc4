"""The delayed update's host step a part at a time (stages 1-2, ``offload_step_delay=1``): see [Note: the delayed
update] and [Note: the delayed update in parts] in ``engine/host_steps.py``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.offload import host_kernel
from lightning_zero.engine.optimizers import Standins, hosted_params, steps_in_parts

#: One call of the host step: its stand-ins and the event behind the copies that read their masters.
PartStep = tuple[Standins, torch.Event | None]


def runs_behind_copies(
    optimizer: Optimizer,
    parts: Sequence[tuple[list[int], list[int]]],
    params: Sequence[nn.Parameter],
    standins: Standins,
    sent: Sequence[torch.Event | None],
    all_sent: torch.Event | None,
) -> list[PartStep]:
    """One call behind ``all_sent`` where the rows did not go a part at a time or ``optimizer`` cannot step in parts."""
    if len(sent) != len(parts) or len(parts) < 2 or not steps_in_parts(optimizer):
        return [(standins, all_sent)]
    runs: list[PartStep] = []
    for (_, indices), copied in zip(parts, sent):
        part = {id(params[i]) for i in indices}
        runs.append(({key: standin if key in part else None for key, standin in standins.items()}, copied))
    return runs


def host_step(view: Optimizer, runs: Sequence[PartStep], kwargs: Mapping[str, Any]) -> Callable[[], object]:

    def step() -> object:
        result = None
        for standins, copied in runs:
            if copied is not None:
                copied.synchronize()
            with hosted_params(view, standins), host_kernel(view):
                result = view.step(**kwargs)
        return result

    return step
