"""Stage 3's gradients where ranks use different parameters of a unit.

[Note: parameters some ranks leave without a gradient]
FSDP2 reduce-scatters, per unit, the gradients its gathered parameters hold on this rank, packed one after the other.
Where ranks use different parameters of a unit (a mixture of experts), the ranks pack different lists, and where the
sizes agree the collective pairs one rank's expert with another's: each expert gets the sum of some other expert's
gradients, silently. So before each unit is reduced every trainable gathered parameter without a gradient on this rank
gets a zero one, and every rank packs the same list, as DDP's ``find_unused_parameters`` and stages 1-2's buckets do.
When backward ends the ranks exchange which parameters any of them used
(:class:`~lightning_zero.engine.comm.used_flags.UsedFlags`), and a parameter no rank used gets ``None`` back: the
optimizer skips it, as in plain PyTorch, instead of decaying it with a zero gradient.

A unit whose forward runs on some ranks only (an expert wrapped as a unit of its own) is another matter: its all-gather
is issued on those ranks only. Keep such modules inside a unit every rank runs; the fault handling names the collective
where they part (``docs/faults.md``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.engine.comm.used_flags import UsedFlags
from lightning_zero.engine.stage3 import fsdp2_private


class UnusedParameters:
    """See [Note: parameters some ranks leave without a gradient]. Frozen parameters are watched too, since a callback
    may unfreeze them during ``fit``."""

    def __init__(
        self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None
    ) -> None:
        self.params = params
        self.index = {id(p): i for i, p in enumerate(params)}
        self.flags = UsedFlags(group, replicate_group, lambda: self._produced.clone())
        self._produced = torch.zeros(len(params), dtype=torch.int32)
        #: Whether each parameter given a zero gradient held one before this backward.
        self._zeroed: dict[int, bool] = {}
        #: The same on every rank, which reduce the same units, so every rank exchanges the flags alike.
        self.pending = False

    def watch(self, groups: Iterable[Any]) -> None:
        for group in groups:
            fsdp2_private.watch_post_backward(group, self._before_reduction)

    def _before_reduction(self, group: Any) -> None:
        completed = fsdp2_private.complete_unit_gradients(group)
        if completed is None:
            return
        if not self.pending:  # the first unit of a synchronising backward
            self._produced.zero_()
            self._zeroed, self.pending = {}, True
        held, zeroed = completed
        for param in held:
            if (i := self.index.get(id(param))) is not None:
                self._produced[i] = 1
        for param in zeroed:
            if (i := self.index.get(id(param))) is not None:
                self._zeroed.setdefault(i, param.grad is not None)  # a second reduction sees the first's zeros

    def produced_here(self, param: torch.Tensor) -> bool:
        """Then some rank did, and its reduced gradient is final."""
        i = self.index.get(id(param))
        return i is not None and bool(self._produced[i])

    def start(self) -> None:
        """Post this rank's flags before the reductions still in flight land."""
        if self.pending:
            self.flags.start()

    def forget_unused(self) -> None:
        if not self.pending:
            return
        used = self.flags.reduced()
        for i, held_before in self._zeroed.items():
            if not used[i] and not held_before:
                self.params[i].grad = None
        self.pending = False
