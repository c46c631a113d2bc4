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

from collections.abc import Iterable

from torch import nn


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
