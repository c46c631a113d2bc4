"""Stage 3's all-gathers posted one unit ahead, in forward and in backward.

[Note: prefetching without streams]
FSDP2 hides a unit's all-gather behind the previous unit's computation by issuing it on a separate CUDA stream. A CPU
has no streams, so each unit's all-gather would start only when the unit is reached, with the training thread waiting
for all of it (``benchmarks/results/2026-11-26-cpu-step-time.md``). FSDP2's explicit prefetching does it without
streams: with ``unshard_async_op`` its all-gathers return a handle, a unit's pre-forward posts the next unit's
all-gather after gathering its own, and backward posts the previous unit's. At most two units are gathered at once, as
with FSDP2's stream prefetching.

The forward order is not the modules' order in general, so the first forward that builds a graph records the order in
which units first run. A unit that does not run in some forward stays prefetched until its next use or FSDP2's
post-backward reshard; nothing is computed with stale values, since prefetching only moves an all-gather earlier.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


class ForwardPrefetch:
    def __init__(self, root: FSDPModule, units: list[nn.Module]) -> None:
        self.units = [u for u in units if isinstance(u, FSDPModule)]
        self.order: list[FSDPModule] = []
        self._seen: set[int] = set()
        root._set_unshard_async_op(True)
        self._handles = [u.register_forward_pre_hook(self._ran) for u in self.units]

    def _ran(self, unit: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled() and unit.training and id(unit) not in self._seen:
            self._seen.add(id(unit))
            self.order.append(cast(FSDPModule, unit))

    def settle(self) -> None:
        if not self._handles or not self.order:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for unit, after in zip(self.order, self.order[1:]):
            unit.set_modules_to_forward_prefetch([after])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
