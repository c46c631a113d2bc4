"""``torch.distributed.pipelining``'s private pieces, and its one difference between releases that matters here.

* The action-list passes a forward-only evaluation of a V-shaped schedule is lowered with (``_Action``,
  ``_add_unshard_reshard``, ``_add_send_recv``, ``_ComputationType``; [Note: evaluating a V] in
  ``pipeline/schedule.py``).
* [Note: a stage's neighbour on its own rank]
  A schedule's first step exchanges a dummy tensor with each neighbouring stage. torch 2.11 does it for every
  neighbour (``_get_init_p2p_neighbors_ops`` in ``_initialize_stages``); in a V-shaped schedule (ZBV, DualPipeV)
  two neighbouring stages sit on the same rank, and gloo cannot send to its own rank ("Pair is not connected"). torch
  2.12 and later warm up through a vote (``_warmup_p2p``) that needs no such exchange. :func:`neighbour_exchange`
  leaves out the exchanges a rank would make with itself: nothing needs connecting there, and each such send is paired
  with a receive left out on the same rank, so the other ranks' exchanges still pair up.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
)

__all__ = [
    "Action",
    "ComputationType",
    "PipelineStageWithoutSelfExchange",
    "add_send_recv",
    "add_unshard_reshard",
    "branches",
    "neighbour_exchange",
]

Action = _Action
ComputationType = _ComputationType
add_send_recv = _add_send_recv
add_unshard_reshard = _add_unshard_reshard

#: Whether this torch's multi-stage schedules warm up by a vote (2.12+) rather than a neighbour exchange.
WARMS_UP_BY_VOTE = hasattr(PipelineScheduleMulti, "_warmup_p2p")


def neighbour_exchange(ops: list[dist.P2POp], group_rank: int) -> list[dist.P2POp]:
    """A stage's first-step exchange ``ops`` without those addressed to its own rank ``group_rank`` in the stage's
    group (see [Note: a stage's neighbour on its own rank])."""
    return [op for op in ops if op.group_peer != group_rank]


class PipelineStageWithoutSelfExchange(PipelineStage):
    """A ``PipelineStage`` whose first-step exchange leaves out its own rank (torch 2.11; see [Note: a stage's
    neighbour on its own rank])."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return neighbour_exchange(super()._get_init_p2p_neighbors_ops(), self.group_rank)


def branches() -> dict[str, str]:
    return {
        "pipelining's first-step warm-up": (
            "a vote (_warmup_p2p, torch 2.12+)"
            if WARMS_UP_BY_VOTE
            else "a dummy exchange with each neighbour, own rank left out (torch 2.11)"
        )
    }
