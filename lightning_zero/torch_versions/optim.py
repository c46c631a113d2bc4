"""torch.optim's private pieces: the global step hooks, and the state some releases make only in a constructor.

[Note: state made in the constructor]
The engine steps the user's optimizer on stand-ins: this rank's shard of a parameter, its host copy, a part of the
parameters (``engine/optimizers.py: hosted_params``). Every optimizer of ``torch.optim`` makes its per-parameter
state in its step when it meets a parameter without any, except ``Adagrad`` in torch 2.11, which makes it only in its
constructor (``state["sum"]``, ``state["step"]``) and fails on a stand-in with ``KeyError: 'sum'``; 2.12 and later
make it in the step too. For such an optimizer :func:`give_standins_state` makes the missing state as that
constructor does (the step count, the accumulator at ``initial_accumulator_value``), so the step is the one a newer
torch takes. Which optimizers need it is probed once per class, on a one-element tensor.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["branches", "give_standins_state", "global_step_hooks_registered", "makes_state_when_stepped"]


def global_step_hooks_registered() -> bool:
    """Whether ``register_optimizer_step_pre_hook`` / ``_post_hook`` put a hook on every optimizer's step."""
    return bool(torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


@functools.cache
def makes_state_when_stepped(optimizer_class: type[Optimizer]) -> bool:
    """Whether a fresh ``optimizer_class`` steps a parameter it was not built with (False: it raises KeyError)."""
    built_with, stepped = torch.zeros(1, requires_grad=True), torch.zeros(1)
    stepped.grad = torch.ones(1)
    build: Any = optimizer_class  # torch.optim's classes take their parameters first, the rest with defaults
    try:
        optimizer = build([built_with])
    except TypeError:  # needs arguments beyond the parameters: not one of torch's, state is its own business
        return True
    optimizer.param_groups[0]["params"] = [stepped]
    try:
        optimizer.step()
    except KeyError:
        return False
    return True


def give_standins_state(optimizer: Optimizer) -> None:
    """Make the state ``optimizer``'s constructor would have made for each parameter in its groups that has a
    gradient and no state, where its class makes state only there (see [Note: state made in the constructor])."""
    if not isinstance(optimizer, torch.optim.Adagrad) or makes_state_when_stepped(torch.optim.Adagrad):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or optimizer.state.get(p):
                continue
            initial = group["initial_accumulator_value"]
            fused = group.get("fused")
            if fused:
                step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
            else:
                step = torch.tensor(0.0, dtype=_get_scalar_dtype())
            value = complex(initial, initial) if torch.is_complex(p) else initial
            optimizer.state[p] = {"step": step, "sum": torch.full_like(p, value, memory_format=torch.preserve_format)}


def branches() -> dict[str, str]:
    eager = not makes_state_when_stepped(torch.optim.Adagrad)
    return {
        "Adagrad's state for a stand-in": (
            "made by lightning_zero as the constructor would (torch 2.11)"
            if eager
            else "made by its own step (torch 2.12+)"
        )
    }
