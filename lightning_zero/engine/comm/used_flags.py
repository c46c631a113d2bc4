"""Which parameters any rank produced a gradient for: the flags both engines exchange when a synchronising backward
ends, so that a parameter no rank used gets no gradient (``None``, as in plain PyTorch and DDP, so the optimizer
skips it instead of decaying it with a zero gradient), whatever each rank contributed to the reduction."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives


class UsedFlags:
    """This rank's flags (``mine()``: an int32 tensor, 1 where this rank produced a gradient), reduced to the flags of
    every rank (of every replica). Over gloo they travel as a point-to-point exchange posted once they are final
    (:meth:`start`, behind the backward's last transfers), so that its latency hides behind theirs instead of ending
    every backward with a blocking all-reduce; other transports all-reduce them in :meth:`reduced`."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        mine: Callable[[], torch.Tensor],
    ) -> None:
        self.group, self.replicate_group, self.mine = group, replicate_group, mine
        self._posted: tuple[torch.Tensor, dist.Work] | None = None

    def start(self) -> None:
        """Post this rank's flags (final now) where point-to-point transfers serve the group."""
        if collectives.exchanges_in_place(self.group):
            mine = self.mine()
            self._posted = mine, collectives.max_in_place(mine, self.group)

    def reduced(self) -> torch.Tensor:
        """Per parameter, 1 if any rank (of every replica) produced a gradient for it, else 0."""
        if self._posted is not None:
            (used, exchange), self._posted = self._posted, None
            exchange.wait()
        else:
            used = collectives.all_reduce(self.mine(), op=collectives.ReduceOp.MAX, group=self.group)
        if self.replicate_group is not None:
            collectives.all_reduce(used, op=collectives.ReduceOp.MAX, group=self.replicate_group)
        return used
