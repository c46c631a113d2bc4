"""``ZeroStrategy(compile=...)``: ``torch.compile`` under every stage.

Lightning refuses ``trainer.fit(torch.compile(model))`` for any strategy but its single-device, DDP and FSDP ones
("Only SingleDeviceStrategy, DDPStrategy, FSDPStrategy support compilation"), and a whole-model compile would
trace the sharding hooks anyway. As torchtitan does, the strategy compiles each block in place once the model is
sharded (``nn.Module.compile``: the module keeps its identity, its hooks, and its parameters): stage 3's all-gather
units, or at stages 1-2 the modules stage 3 would make units (``wrap_policy``; by default the elements of
``nn.ModuleList``s). Gradient hooks, all-gathers and reduce-scatters stay outside the compiled graphs. Calling
``self.block.compile()`` in ``configure_model`` works too, at every stage.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_zero.choices import ZeroConfigError

_COMPILE_ARGUMENTS = tuple(p for p in inspect.signature(torch.compile).parameters if p != "model")


def check_compile(value: Any) -> None:
    """``compile`` is a bool or a dict of ``torch.compile`` keyword arguments."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict):
        raise ZeroConfigError(
            f"`compile` must be True, False or a dict of torch.compile arguments {_COMPILE_ARGUMENTS}, got {value!r}."
        )
    unknown = sorted(set(value) - set(_COMPILE_ARGUMENTS))
    if unknown:
        raise ZeroConfigError(
            f"`compile` has arguments torch.compile does not take: {unknown}; it takes {_COMPILE_ARGUMENTS}."
        )


def compile_units(units: Iterable[nn.Module], compile: bool | dict) -> int:
    """Compile each of ``units`` in place (``compile``: True, or torch.compile's arguments); how many."""
    if not compile:
        return 0
    options = compile if isinstance(compile, dict) else {}
    count = 0
    for unit in units:
        unit.compile(**options)
        count += 1
    return count
