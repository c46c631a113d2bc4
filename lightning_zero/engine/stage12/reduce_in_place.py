"""One bucket's gradient reduce-scatter without its bucket-sized buffer (stages 1-2 over gloo).

The packed reduction copies every gradient of the bucket into a fresh rank-major buffer, reduces it and copies this
rank's segment out. Here each rank sends every other rank that rank's rows of each gradient straight out of
``p.grad`` and receives the other ranks' contributions to its own rows into one segment per peer (stage 2: the
first straight into the bucket's shard storage), which :meth:`InPlaceReduction.land` adds to its own rows.
See [Note: collectives in place] in ``p2p_transport.py``; with 2 ranks the sums are the packed ring's, bit for bit
(``mine + peer``: a two-term float sum does not depend on its order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.stage12.buckets import rows_by_rank, segment_parts
from lightning_zero.engine.stage12.layout import ShardLayout


class InPlaceReduction:
    """Posts one bucket's transfers on construction; :meth:`land` waits and sums. ``storage``: stage 2's shard
    storage of the bucket, ``held`` when it holds sums from an earlier backward (the reduced rows are added to
    them); otherwise the first peer's contributions land in it."""

    def __init__(
        self,
        layout: ShardLayout,
        bucket_index: int,
        grads: Sequence[torch.Tensor | None],
        *,
        rank: int,
        group: dist.ProcessGroup | None = None,
        storage: torch.Tensor | None = None,
        held: bool = False,
    ) -> None:
        bucket = layout.buckets[bucket_index]
        self.specs = [layout.params[i] for i in bucket.params]
        self.rank, world = rank, layout.world_size
        #: ``p.grad`` of the bucket's parameters (None: no gradient here, contributing zeros), kept alive until
        #: their sends complete.
        self.grads = list(grads)
        like = next((g for g in self.grads if g is not None), None)
        self.dtype = storage.dtype if storage is not None else like.dtype if like is not None else torch.float32
        self.device = storage.device if storage is not None else like.device if like is not None else torch.device("cpu")
        self.storage, self.held = storage, held
        self.into_storage = storage is not None and not held
        peers = [(rank - distance) % world for distance in range(1, world)]
        #: The segment each peer's contributions land in: the first one's the storage itself when it holds nothing.
        self.segments: dict[int, torch.Tensor] = {
            peer: storage if storage is not None and k == 0 and self.into_storage
            else torch.empty(bucket.segment_numel, dtype=self.dtype, device=self.device)
            for k, peer in enumerate(peers)
        }
        #: Every rank's rows of each gradient (None: no gradient here), one ``split`` per gradient.
        self.rows = [None if g is None else rows_by_rank(g.view(-1), spec) for g, spec in zip(self.grads, self.specs)]
        #: With every gradient here, this rank's rows of each, and every other rank's (zeroed once the sums land at
        #: stage 1); None otherwise.
        self.own: list[torch.Tensor] | None = None
        self.others: list[torch.Tensor] = []
        if all(rows is not None for rows in self.rows):  # one transpose of the rows, no call per parameter
            by_rank: list[list[torch.Tensor]] = [list(of_rank) for of_rank in zip(*self.rows)]
            self.own, self.others = by_rank[rank], [part for r in range(world) if r != rank for part in by_rank[r]]
        else:
            by_rank = [[self._rows(j, r) for j in range(len(self.specs))] for r in range(world)]
        sends = [by_rank[r] if r != rank else [] for r in range(world)]
        #: Per peer, the views of its segment that receive its contribution to each parameter's rows.
        self.received: dict[int, list[torch.Tensor]] = {
            peer: segment_parts(segment, layout, bucket_index, rank) for peer, segment in self.segments.items()
        }
        receives = [self.received.get(peer, []) for peer in range(world)]
        self.work = collectives.reduce_scatter_in_place(
            sends, receives, bucket.numel, group=group, chunk_numels=[spec.chunk_numel for spec in self.specs]
        )
        self._storage_parts = segment_parts(storage, layout, bucket_index, rank) if storage is not None else None

    def _rows(self, j: int, rank: int) -> torch.Tensor:
        """Parameter ``j``'s gradient rows of ``rank``, flat (zeros where this rank has no gradient)."""
        rows = self.rows[j]
        if rows is None:
            return torch.zeros(self.specs[j].rank_numels[rank], dtype=self.dtype, device=self.device)
        return rows[rank]

    def land(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Wait, then leave each parameter's reduced rows where its stage keeps them: stage 2 in the shard storage
        (added to what it held), dropping ``p.grad``; stage 1 in this rank's rows of ``p.grad``, its other rows
        zeroed (see [Note: gradients are held as sums until finalized] in ``grad_sync.py``). One ``foreach`` kernel
        per peer for the whole bucket, in the order the sums are defined: each element's terms are added in the
        same order as one parameter at a time would."""
        self.work.wait()
        if not params:
            return
        if self.storage is not None:
            self._sum_into_storage()
            for param in params:
                param.grad = None
            return
        own, others = self.own, self.others  # this rank's own contribution is already in its rows
        if own is None or not all(param.grad is grad for param, grad in zip(params, self.grads)):
            own, others = [], []  # a gradient missing here, or made or replaced since the launch
            for j, param in enumerate(params):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                rows = self.rows[j] if param.grad is self.grads[j] else None
                if rows is None:
                    rows = rows_by_rank(param.grad.view(-1), self.specs[j])
                own.append(rows[self.rank])
                others.extend(part for r, part in enumerate(rows) if r != self.rank)
        for peer in self.segments:
            torch._foreach_add_(own, self.received[peer])
        if others:
            torch._foreach_zero_(others)

    def _sum_into_storage(self) -> None:
        """Each parameter's own contribution and every peer's into its rows of the shard storage: written where the
        storage held nothing (it holds the first peer's already), else added to the sums it held."""
        targets = self._storage_parts
        if targets is None:
            raise RuntimeError("only stage 2 reduces into shard storage")
        own = self.own if self.own is not None else [self._rows(j, self.rank) for j in range(len(self.specs))]
        received = [self.received[peer] for peer in self.segments]
        if self.into_storage:
            torch._foreach_add_(targets, own)
            for parts in received[1:]:
                torch._foreach_add_(targets, parts)
            return
        totals = own
        for parts in received:
            totals = list(torch._foreach_add(totals, parts))
        torch._foreach_add_(targets, totals)
