"""The post-step all-gather of stages 1-2: every rank's updated rows into every rank's resident parameters.

The rows travel bucket by bucket, overlapping the packing (or, with offload, the host->device copy of the masters) of
one bucket with the gather of the previous.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.compression import CompressedComm
from lightning_zero.engine.offload.masters import MasterShards
from lightning_zero.engine.stage12.buckets import pack_segment, rows_by_rank, unpack_bucket
from lightning_zero.engine.stage12.grad_bucket import Pending
from lightning_zero.engine.stage12.grad_sync import MAX_BUCKETS_IN_FLIGHT
from lightning_zero.engine.stage12.layout import BucketSpec, ShardLayout


def all_gather_params(
    layout: ShardLayout,
    params: Sequence[nn.Parameter],
    buckets: Iterable[int],
    *,
    rank: int,
    group: dist.ProcessGroup | None = None,
    masters: MasterShards | None = None,
    indices: Iterable[int] | None = None,
    compression: CompressedComm | None = None,
    row_views: RowViews | None = None,
) -> None:
    """In place over gloo (see [Note: collectives in place] in ``p2p_transport.py``), else packed. With ``compression``
    of parameters this rank's rows too become the decoded ones (see [Note: whose values are decoded] in
    ``compression.py``); the masters stay exact."""
    row_views = row_views or RowViews(layout)
    wanted = set(range(len(params)) if indices is None else indices) if masters is not None else set()

    detached: list[torch.Tensor] = []

    def sources() -> list[torch.Tensor]:
        if not detached:
            detached.extend(p.detach() for p in params)
        return detached

    def copy_masters(bucket: BucketSpec) -> list[list[torch.Tensor]]:
        pieces = row_views.of_bucket(bucket, params)
        if masters is not None:
            with torch.no_grad():
                masters.copy_all_into([(i, pieces[rank][j]) for j, i in enumerate(bucket.params) if i in wanted])
        return pieces

    if layout.world_size == 1:
        for b in buckets:
            copy_masters(layout.buckets[b])
        return
    flights: list[tuple[BucketSpec, Pending | None, torch.Tensor | None, bool]] = []
    in_place = collectives.exchanges_in_place(group)

    def land(bucket: BucketSpec, work: Pending | None, full: torch.Tensor | None, decoded: bool) -> None:
        if work is not None:
            work.wait()
        if full is None:  # gathered in place
            return
        with torch.no_grad():  # own rows are already in place, unless they were encoded and decoded too
            unpack_bucket(layout, bucket, full, sources(), skip_rank=None if decoded else rank)

    for b in buckets:
        bucket = layout.buckets[b]
        pieces = copy_masters(bucket)
        like = params[bucket.params[0]]
        encoded = compression is not None and compression.compresses_params(like.dtype)
        if in_place and not encoded:
            chunks = row_views.chunk_numels(bucket)
            flights.append(
                (
                    bucket,
                    collectives.all_gather_in_place(pieces, bucket.numel, group=group, chunk_numels=chunks),
                    None,
                    False,
                )
            )
        else:
            segment = pack_segment(
                layout,
                bucket,
                rank,
                sources(),
                torch.empty(bucket.segment_numel, dtype=like.dtype, device=like.device),
            )
            full = torch.empty(bucket.numel, dtype=segment.dtype, device=segment.device)
            if compression is not None and encoded:
                flights.append((bucket, compression.all_gather(full, segment, group), full, True))
            else:
                flights.append((bucket, collectives.all_gather(full, segment, group=group, async_op=True), full, False))
        if len(flights) > MAX_BUCKETS_IN_FLIGHT:  # bound the full-size buffers alive at once
            land(*flights.pop(0))
    for flight in flights:
        land(*flight)


class RowViews:
    """The in-place all-gather's pieces, kept while the parameters keep their memory, since making them costs per
    parameter and rank, every step. ``data_ptr`` is a safe check: a kept view holds the old storage alive, so a
    parameter given new memory always has a new address."""

    def __init__(self, layout: ShardLayout) -> None:
        self.layout = layout
        self._by_bucket: dict[int, tuple[list[int], list[list[torch.Tensor]]]] = {}
        self._chunks: dict[int, list[int]] = {}

    def of_bucket(self, bucket: BucketSpec, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``[rank][j]``: rank's rows of the bucket's ``j``-th parameter."""
        addresses = [params[i].data_ptr() for i in bucket.params]
        kept = self._by_bucket.get(bucket.index)
        if kept is None or kept[0] != addresses:
            rows = [rows_by_rank(params[i].detach().view(-1), self.layout.params[i]) for i in bucket.params]
            kept = self._by_bucket[bucket.index] = (addresses, [list(of_rank) for of_rank in zip(*rows)])
        return kept[1]

    def chunk_numels(self, bucket: BucketSpec) -> list[int]:
        if (chunks := self._chunks.get(bucket.index)) is None:
            chunks = self._chunks[bucket.index] = [self.layout.params[i].chunk_numel for i in bucket.params]
        return chunks
