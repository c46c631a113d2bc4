"""One bucket's gradient reduce-scatter without its bucket-sized buffer (stages 1-2 over gloo).

Each rank sends every other rank that rank's rows of each gradient straight out of ``p.grad`` and receives the other
ranks' contributions to its own rows into one segment per peer (stage 2: the first straight into the bucket's shard
storage), which :meth:`InPlaceReduction.land` adds to its own rows. See [Note: collectives in place] in
``p2p_transport.py``; with 2 ranks the sums are the packed ring's, bit for bit (a two-term float sum does not depend
on its order).

[Note: small gradients travel as runs]
Adjacent small pieces travel as one transfer (``p2p_transport.packed_runs``), packed by one ``torch._chunk_cat``, which
lays them out rank-major exactly as the bucket is ([Note: rank-major buckets]). A run's row for a peer is then one
contiguous tensor to send and its place in a segment one contiguous slice: no view per gradient and rank, and the sums
of a run are two flat kernels, not a kernel per parameter. At stage 1 the summed rows then become new gradients, views
of one flat buffer of the run, where writing them into the old ``p.grad`` would take a view and two kernels per
parameter. A model of hundreds of narrow tensors pays per parameter what the bytes cost, so this is where its step goes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives, p2p_transport
from lightning_zero.engine.stage12.buckets import rows_by_rank
from lightning_zero.engine.stage12.layout import ShardLayout
from lightning_zero.torch_versions.tensors import chunk_cat, unflatten_dense_tensors


@dataclasses.dataclass(frozen=True)
class TransferRun:
    """Pieces ``[start, end)`` of a bucket that travel as one transfer, occupying ``[low, high)`` of every segment; not
    ``packed``: one piece alone, its rows sent as views."""

    start: int
    end: int
    low: int
    high: int
    packed: bool


def transfer_runs(layout: ShardLayout, bucket_index: int, itemsize: int) -> list[TransferRun]:
    """See [Note: small gradients travel as runs]; the same on every rank."""
    key = ("runs", bucket_index, itemsize, p2p_transport.PACK_PIECE_BYTES)
    runs = layout.memo.get(key)
    if runs is None:
        specs = [layout.params[i] for i in layout.buckets[bucket_index].params]
        runs = layout.memo[key] = [
            TransferRun(
                a,
                b,
                specs[a].offset,
                specs[b - 1].offset + specs[b - 1].chunk_numel,
                specs[a].chunk_numel * itemsize <= p2p_transport.PACK_PIECE_BYTES,
            )
            for a, b in p2p_transport.packed_runs([s.chunk_numel for s in specs], itemsize)
        ]
    return runs


def param_order_index(layout: ShardLayout, bucket_index: int, run: TransferRun, device: torch.device) -> torch.Tensor:
    """For each element of a packed run's gradients flattened one after another, its place in the run's rank-major rows.
    Kept on the layout: 4 bytes per element of small pieces, a bucket at most."""
    key = ("param order", bucket_index, run, device)
    index = layout.memo.get(key)
    if index is None:
        specs = [layout.params[i] for i in layout.buckets[bucket_index].params[run.start : run.end]]
        index = torch.empty(sum(s.numel for s in specs), dtype=torch.int32)
        width, start = run.high - run.low, 0
        for spec in specs:
            for rank in range(layout.world_size):
                first, last = spec.element_range(rank)
                at = rank * width + spec.offset - run.low
                index[start + first : start + last] = torch.arange(at, at + last - first, dtype=torch.int32)
            start += spec.numel
        index = layout.memo[key] = index.to(device)
    return index


class InPlaceReduction:
    """Posts one bucket's transfers on construction; :meth:`land` waits and sums. ``held``: stage 2's ``storage`` holds
    sums from an earlier backward; otherwise the first peer's contributions land in it."""

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
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        bucket = layout.buckets[bucket_index]
        self.layout, self.bucket_index = layout, bucket_index
        self.specs = [layout.params[i] for i in bucket.params]
        self.rank, world = rank, layout.world_size
        #: Kept alive until their sends complete.
        self.grads = list(grads)
        like = next((g for g in self.grads if g is not None), None)
        # A rank with no gradient in the bucket must still send the same bytes, in the same runs, as the others.
        self.dtype = dtype or (
            storage.dtype if storage is not None else like.dtype if like is not None else torch.float32
        )
        self.device = device or (
            storage.device if storage is not None else like.device if like is not None else torch.device("cpu")
        )
        self.storage, self.held = storage, held
        self.into_storage = storage is not None and not held
        peers = [(rank - distance) % world for distance in range(1, world)]
        self.segments: dict[int, torch.Tensor] = {
            peer: storage
            if storage is not None and k == 0 and self.into_storage
            else torch.empty(bucket.segment_numel, dtype=self.dtype, device=self.device)
            for k, peer in enumerate(peers)
        }
        self.runs = transfer_runs(layout, bucket_index, self.dtype.itemsize)
        self.packed: list[torch.Tensor | None] = []
        self.rows: list[tuple[torch.Tensor, ...] | None] = [None] * len(self.specs)
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for run in self.runs:
            if run.packed:  # ``_chunk_cat`` refuses empty tensors; an empty parameter takes no room in the bucket
                whole = [self._whole(j) for j in range(run.start, run.end) if self.specs[j].chunk_numel]
                packed = (
                    chunk_cat(whole, 0, world) if whole else torch.zeros(world, 0, dtype=self.dtype, device=self.device)
                )
                self.packed.append(packed)
                pieces: Sequence[torch.Tensor] = packed.unbind(0)
            else:
                self.packed.append(None)
                j = run.start
                if self.grads[j] is not None:
                    self.rows[j] = rows_by_rank(self.grads[j].view(-1), self.specs[j])  # type: ignore[union-attr]
                pieces = [self._rows(j, r) for r in range(world)]
            for r in range(world):
                if r != rank:
                    sends[r].append(pieces[r])
        #: A piece alone lands unpadded, as the sender sends just its rows.
        self.received: dict[int, list[torch.Tensor]] = {
            peer: [
                segment[run.low : run.high]
                if run.packed
                else segment[run.low : run.low + self.specs[run.start].rank_numels[rank]]
                for run in self.runs
            ]
            for peer, segment in self.segments.items()
        }
        receives = [self.received.get(peer, []) for peer in range(world)]
        self.work = collectives.reduce_scatter_in_place(sends, receives, bucket.numel, group=group)
        self.flats: list[tuple[torch.Tensor, Sequence[int]]] = []

    def _whole(self, j: int) -> torch.Tensor:
        grad = self.grads[j]
        if grad is None:
            return torch.zeros(self.specs[j].shape or (1,), dtype=self.dtype, device=self.device)
        return grad.view(1) if grad.dim() == 0 else grad

    def _rows(self, j: int, rank: int) -> torch.Tensor:
        rows = self.rows[j]
        if rows is None:
            return torch.zeros(self.specs[j].rank_numels[rank], dtype=self.dtype, device=self.device)
        return rows[rank]

    def land(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Leave each parameter's reduced rows where its stage keeps them (see
        [Note: gradients are held as sums until finalized] in ``grad_sync.py``). Each element's terms are added in the
        same order as one parameter at a time would: this rank's, then each peer's in turn."""
        self.work.wait()
        if not params:
            return
        for k, run in enumerate(self.runs):
            received = [parts[k] for parts in self.received.values()]
            if self.storage is not None:
                self._sum_into_storage(k, run, received)
            elif (packed := self.packed[k]) is not None and all(
                params[j].grad is self.grads[j] for j in range(run.start, run.end)
            ):
                self._sum_into_new_grads(packed, run, received, params)
            else:  # a piece alone, or a gradient made or replaced since the launch: its own rows now take the sums
                self._sum_into_current_grads(k, run, received, params)
        if self.storage is not None:
            for param in params:
                param.grad = None

    def _own(self, k: int, run: TransferRun) -> torch.Tensor:
        packed = self.packed[k]
        return packed[self.rank] if packed is not None else self._rows(run.start, self.rank)

    def _sum_into_storage(self, k: int, run: TransferRun, received: list[torch.Tensor]) -> None:
        storage = self.storage
        if storage is None:
            raise RuntimeError("only stage 2 reduces into shard storage")
        own = self._own(k, run)
        if self.into_storage:
            target = received[0]
            target.add_(own)
            for part in received[1:]:
                target.add_(part)
            return
        total = own.clone()
        for part in received:
            total.add_(part)
        storage[run.low : run.low + total.numel()].add_(total)

    def _sum_into_new_grads(
        self, packed: torch.Tensor, run: TransferRun, received: list[torch.Tensor], params: Sequence[torch.nn.Parameter]
    ) -> None:
        """See [Note: small gradients travel as runs]."""
        for part in received:  # the sends are complete: the packed rows are ours to reuse
            packed[self.rank].add_(part)
        for r in range(len(packed)):
            if r != self.rank:
                packed[r].zero_()
        flat = packed.view(-1).index_select(0, param_order_index(self.layout, self.bucket_index, run, packed.device))
        run_params = params[run.start : run.end]
        for param, grad in zip(run_params, unflatten_dense_tensors(flat, run_params)):
            param.grad = grad
        self.flats.append((flat, self.layout.buckets[self.bucket_index].params[run.start : run.end]))

    def _sum_into_current_grads(
        self, k: int, run: TransferRun, received: list[torch.Tensor], params: Sequence[torch.nn.Parameter]
    ) -> None:
        for j in range(run.start, run.end):
            param, spec = params[j], self.specs[j]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            rows = rows_by_rank(param.grad.view(-1), spec)
            offset = spec.offset - run.low if self.packed[k] is not None else 0
            for part in received:
                rows[self.rank].add_(part[offset : offset + spec.rank_numels[self.rank]])
            for r, other in enumerate(rows):
                if r != self.rank:
                    other.zero_()
