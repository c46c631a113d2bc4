"""Which parameters any rank produced a gradient for, exchanged when a synchronising backward ends, so that a
parameter no rank used gets ``None``, as in plain PyTorch and DDP, and the optimizer skips it instead of decaying it
with a zero gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives


class UsedFlags:
    """Over gloo the flags travel as a point-to-point exchange posted behind the backward's last transfers
    (:meth:`start`), so that its latency hides behind theirs instead of ending every backward with a
    blocking all-reduce."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        mine: Callable[[], torch.Tensor],
    ) -> None:
        self.group, self.replicate_group, self.mine = group, replicate_group, mine
        self._posted: tuple[torch.Tensor, dist.Work] | None = None

    def start(self) -> None:
        if collectives.exchanges_in_place(self.group):
            mine = self.mine()
            self._posted = mine, collectives.max_in_place(mine, self.group)

    def reduced(self) -> torch.Tensor:
        if self._posted is not None:
            (used, exchange), self._posted = self._posted, None
            exchange.wait()
        else:
            used = collectives.all_reduce(self.mine(), op=collectives.ReduceOp.MAX, group=self.group)
        if self.replicate_group is not None:
            collectives.all_reduce(used, op=collectives.ReduceOp.MAX, group=self.replicate_group)
        return used
