"""Gradient reduction for stages 1 and 2: post-accumulate-grad hooks fill rank-major buckets, each bucket is
reduce-scattered during backward once it and every earlier bucket are full, and this rank keeps only its shard.

[Note: gradients are held as sums until finalized]
Reduce-scatter runs with ``SUM``; the average over ranks (and a loss-scale unscale) is applied once per optimizer step
by :meth:`GradientReducer.finalize`. Holding sums keeps several synchronising backwards exact: at stage 1 a rank's own
chunk of ``p.grad`` holds the reduced sum while the other chunks restart from zero, so the next reduce-scatter adds
``previous sum + new local gradients of every rank``; pre-dividing would divide the previous sum again.

Stage 1 keeps the full ``p.grad``; stage 2 drops ``p.grad`` once it is packed and receives the reduced shard into a flat
per-bucket storage, so full gradients never outlive their bucket.

Under hybrid sharding (``replicate_group``, see ``topology.py``) the held sums are the shard group's;
:meth:`GradientReducer.finalize` all-reduces them across the replica group once per step. Reducing there rather than as
each bucket lands is what keeps several backwards exact: stage 1's own chunk holds a sum that autograd then adds to,
which a per-backward all-reduce would count once per replica.

Under a mixed-precision policy the held sums stay in the parameters' 2-byte dtype and :meth:`GradientReducer.finalize`
makes fresh fp32 gradients for the masters: unscaling a loss-scaled fp16 gradient in fp16 would flush its small values
to zero. With ``offload_optimizer`` they are made in host memory as each bucket lands (see [Note: the offloaded step]
in ``engine/offload/schedule.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.compression import CompressedComm
from lightning_zero.engine.comm.used_flags import UsedFlags
from lightning_zero.engine.offload.masters import MasterShards, master_dtype_of
from lightning_zero.engine.row_major import gradient_form_error
from lightning_zero.engine.stage12 import buckets
from lightning_zero.engine.stage12.grad_records import GradState, ParamGradient, produced_flags
from lightning_zero.engine.stage12.layout import BucketSpec, ShardLayout
from lightning_zero.engine.stage12.reduce_in_place import InPlaceReduction

#: Reductions allowed in flight before the oldest is landed; two keep the link busy while bounding memory.
MAX_BUCKETS_IN_FLIGHT = 2


class Pending(Protocol):
    def wait(self) -> object: ...


@dataclasses.dataclass
class _Inflight:
    bucket: int
    work: Pending | None
    comm: torch.Tensor | None
    out: torch.Tensor | None
    direct: bool
    """``out`` is the storage slice itself (stage 2, clean bucket)."""
    accumulate: bool
    """Stage 2: the storage slice holds earlier sums that ``out`` adds to."""
    in_place: InPlaceReduction | None = None  # a reduction without ``comm`` and ``out`` (``reduce_in_place.py``)


class GradientReducer:
    """Reduce-scatters the gradients of ``params`` (the trainable parameters, in layout order)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        layout: ShardLayout,
        *,
        rank: int,
        shard_gradients: bool,
        overlap_comm: bool = True,
        reduce_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
        host_gradients: MasterShards | None = None,
        group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        compression: CompressedComm | None = None,
    ) -> None:
        self.params = list(params)
        self.compression = compression
        self.layout, self.rank, self.world_size = layout, rank, layout.world_size
        self.shard_gradients, self.overlap_comm = shard_gradients, overlap_comm
        self.group = group
        self.replicate_group = replicate_group
        self.replicas = collectives.world_size(replicate_group) if replicate_group is not None else 1
        self.produced = UsedFlags(
            group, replicate_group if self.replicas > 1 else None, lambda: produced_flags(self.records)
        )
        self.require_sync = True
        self._ready = [0] * len(layout.buckets)
        self._sizes = [len(b.params) for b in layout.buckets]
        self._next = 0  # the next bucket to launch (see [Note: every rank launches buckets in the same order])
        self._inflight: list[_Inflight] = []
        #: Whether a window's start has anything to clear.
        self._holding = False
        self.master_dtype = master_dtype
        self.host_gradients = host_gradients
        #: Not under hybrid sharding: :meth:`finalize` adds the replicas' sums first.
        self.stages_on_landing = host_gradients is not None and host_gradients.offloaded and self.replicas == 1
        self.on_landed: Callable[[int], None] | None = None
        self.device = self.params[0].device if self.params else torch.device("cpu")
        #: Each bucket holds parameters of one dtype (see ``plan_layout(classes=...)``).
        self.bucket_dtypes = [self.params[b.params[0]].dtype for b in layout.buckets]
        self.reduce_dtype = reduce_dtype
        self.comm_dtypes = [comm_dtype(dtype, reduce_dtype) for dtype in self.bucket_dtypes]
        self.storage = (
            [
                torch.zeros(b.segment_numel, device=self.device, dtype=dtype)
                for b, dtype in zip(layout.buckets, self.bucket_dtypes)
            ]
            if shard_gradients
            else None
        )
        #: Flat buffers the sums are views of, so scaling is one op per buffer rather than per parameter.
        self.storage_runs = [(s, b.params) for s, b in zip(self.storage, layout.buckets)] if self.storage else []
        self.flat_runs: list[tuple[torch.Tensor, Sequence[int]]] = []
        self.records = [
            ParamGradient(i, p, layout.params[i], self._storage_view(i) if shard_gradients else None)
            for i, p in enumerate(self.params)
        ]
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]

    # ------------------------------------------------------------------ views
    def _bucket_storage(self, bucket: int) -> torch.Tensor:
        if self.storage is None:
            raise RuntimeError("only stage 2 holds gradient shards in bucket storage")
        return self.storage[bucket]

    def _storage_view(self, index: int) -> torch.Tensor:
        spec = self.layout.params[index]
        return buckets.segment_view(self.layout, self._bucket_storage(spec.bucket), index, self.rank)

    def local_grad(self, index: int) -> torch.Tensor | None:
        """This rank's shard of parameter ``index``'s gradient: the held sum until :meth:`finalize`, then the
        finalized gradient."""
        record = self.records[index]
        if record.state is GradState.FINALIZED:
            return record.final
        if self.shard_gradients:
            return record.shard if record.state is GradState.REDUCED else None
        grad = record.param.grad
        if grad is None:
            return None
        if record.own_rows is None or record.own_rows[0] is not grad:
            start, end = record.spec.row_range(self.rank)
            record.own_rows = (grad, (grad.view(1) if record.spec.shape == () else grad)[start:end])
        return record.own_rows[1]

    def held_gradients(self) -> list[torch.Tensor]:
        """Gradient tensors the reducer itself owns, for memory accounting (stage 1's are the ``.grad``)."""
        return [*(self.storage or []), *(r.final for r in self.records if r.final is not None)]

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        self._holding = True
        record = self.records[index]
        record.staged = None  # the sum is changing: its host copy, if any, is stale
        if not self.require_sync:
            return
        if record.state is GradState.FINALIZED:
            raise RuntimeError(
                f"Parameter {record.spec.name!r} received a new gradient after its gradients were "
                "finalized for an optimizer step (clipping or unscaling) but before that step ran. Call "
                "`optimizer.step()` (or skip it) before the next backward."
            )
        bucket = record.spec.bucket
        self._ready[bucket] += 1
        if self.overlap_comm and bucket == self._next and self._ready[bucket] == self._sizes[bucket]:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """[Note: every rank launches buckets in the same order]
        Concurrent reduce-scatters are matched by posting order alone, so a rank that launched bucket 1 before bucket 0
        (say, a parameter unused only on that rank) would pair its segments with another bucket's on its peers. Buckets
        are planned in the order gradients usually arrive, so launching in index order rarely delays one.
        """
        while self._next < len(self.layout.buckets):
            bucket = self._next
            if self._ready[bucket] < self._sizes[bucket]:
                return
            self._launch(bucket)

    def _launch(self, bucket_index: int) -> None:
        bucket, dtype = self.layout.buckets[bucket_index], self.bucket_dtypes[bucket_index]
        self._holding = True
        sources: list[torch.Tensor | None] = [None] * len(self.params)
        for i in bucket.params:
            sources[i] = grad = self.params[i].grad
            if grad is not None and (grad.is_sparse or grad.dtype != dtype):
                raise gradient_form_error(self.records[i].spec.name, grad, dtype)
            self.records[i].produced |= grad is not None
        if self._reduces_in_place(bucket_index):
            held = self.shard_gradients and self._holds_sums(bucket)
            reduction = InPlaceReduction(
                self.layout,
                bucket_index,
                [sources[i] for i in bucket.params],
                rank=self.rank,
                group=self.group,
                storage=self._bucket_storage(bucket_index) if self.shard_gradients else None,
                held=held,
                dtype=dtype,
                device=self.device,
            )
            return self._post(_Inflight(bucket_index, None, None, None, False, held, reduction))
        comm = torch.empty(bucket.numel, dtype=self.comm_dtypes[bucket_index], device=self.device)
        buckets.pack_bucket(self.layout, bucket, sources, comm)
        direct = accumulate = False
        if self.shard_gradients:
            for i in bucket.params:
                self.params[i].grad = None
            accumulate = self._holds_sums(bucket)
            direct = not accumulate and comm.dtype == self.bucket_dtypes[bucket_index]
        if direct:
            out = self._bucket_storage(bucket_index)
        else:
            out = torch.empty(bucket.segment_numel, dtype=comm.dtype, device=comm.device)
        if self.compression is not None:
            work = self.compression.reduce_scatter(out, comm, self.group, key=bucket_index)
        else:
            work = collectives.reduce_scatter(out, comm, group=self.group, async_op=True)
        self._post(_Inflight(bucket_index, work, comm, out, direct, accumulate))

    def _reduces_in_place(self, bucket_index: int) -> bool:
        """See ``reduce_in_place.py``; every rank decides alike (same backend, settings and layout)."""
        return (
            self.compression is None
            and self.comm_dtypes[bucket_index] == self.bucket_dtypes[bucket_index]
            and collectives.exchanges_in_place(self.group)
        )

    def _post(self, flight: _Inflight) -> None:
        self._next = flight.bucket + 1
        self._inflight.append(flight)
        if self._next == len(self.layout.buckets):  # behind the last bucket's transfers: the flags are final now
            self.produced.start()
        # Bound the buffers alive at once, stage 2's below a whole gradient.
        while len(self._inflight) > MAX_BUCKETS_IN_FLIGHT:
            self._land(self._inflight.pop(0))

    def flush(self) -> None:
        """End of a synchronising backward: reduce the buckets that never filled (parameters unused on this rank
        contribute zeros) and land every shard."""
        if not self.require_sync:
            return
        while self._next < len(self.layout.buckets):
            self._launch(self._next)
        while self._inflight:
            self._land(self._inflight.pop(0))
        self._ready = [0] * len(self.layout.buckets)
        self._next = 0
        self._forget_gradients_no_rank_produced()

    def _forget_gradients_no_rank_produced(self) -> None:
        """A parameter no rank used has no gradient (see ``comm/used_flags.py``); one any rank used keeps the sum."""
        used = self.produced.reduced()
        for i in torch.nonzero(used == 0).flatten().tolist():
            record = self.records[i]
            if record.state is GradState.REDUCED:
                record.state = GradState.UNUSED
            if not self.shard_gradients:
                record.param.grad, record.own_rows = None, None

    def _land(self, flight: _Inflight) -> None:
        if flight.work is not None:
            flight.work.wait()
        bucket = self.layout.buckets[flight.bucket]
        if flight.in_place is not None:
            flight.in_place.land([self.params[i] for i in bucket.params])
            if flats := flight.in_place.flats:  # they replace the runs of an earlier backward of the window
                self.flat_runs = buckets.runs_without(self.flat_runs, (i for _, ix in flats for i in ix)) + flats
            self._landed(bucket)
            return
        if flight.out is None:
            raise RuntimeError(f"bucket {flight.bucket}'s reduction has no output")
        if self.shard_gradients:
            if flight.accumulate:
                self._bucket_storage(flight.bucket).add_(flight.out)
            elif not flight.direct:
                self._bucket_storage(flight.bucket).copy_(flight.out)
        else:
            buckets.land_in_own_rows(self.layout, flight.bucket, self.params, flight.out, self.rank)
        self._landed(bucket)

    def _landed(self, bucket: BucketSpec) -> None:
        for i in bucket.params:
            record = self.records[i]
            record.landed = True
            if record.state is not GradState.FINALIZED:
                record.state = GradState.REDUCED
        if self.stages_on_landing and self.host_gradients is not None:
            held = [
                (i, g)
                for i in bucket.params
                if self.host_gradients.on_host[i] and (g := self.local_grad(i)) is not None
            ]
            for (i, _), copy in zip(held, self.host_gradients.stage_gradients(held)):
                self.records[i].staged = copy
            if self.on_landed is not None:  # see [Note: the host step during backward]
                self.on_landed(bucket.index)

    # ------------------------------------------------------------------ step
    def finalize(self, indices: Iterable[int], scale: float = 1.0) -> None:
        """Turn the held sums of ``indices`` into the averaged gradient, once."""
        if self._inflight or any(self._ready):
            # A backward ran outside ``strategy.backward`` (a bare ``loss.backward()``).
            self.flush()
        pending = [i for i in indices if self.records[i].state is not GradState.FINALIZED]
        if not pending:  # the step's own call after clipping or unscaling finalized them
            return
        self._holding = True
        held_by_index = {i: self.local_grad(i) for i in pending}
        if self.replicas > 1:
            sums = [g for g in held_by_index.values() if g is not None]
            sum_over_replicas(self.replicate_group, sums, self.reduce_dtype, self.compression)
        grads = []
        unstaged: list[tuple[int, torch.Tensor]] = []
        narrow: list[tuple[int, torch.Tensor]] = []
        in_place: dict[int, torch.Tensor] = {}
        for i, held in held_by_index.items():
            record = self.records[i]
            record.state = GradState.FINALIZED
            if held is None:
                continue
            if self.host_gradients is not None:
                if record.staged is None:
                    unstaged.append((i, held))
                    continue
                grad = record.staged
            elif held.dtype != master_dtype_of(held.dtype, self.master_dtype):
                narrow.append((i, held))
                continue
            else:
                grad = in_place[i] = held
            record.final = grad
            grads.append(grad)
        if narrow and self.master_dtype is not None:
            for (i, _), grad in zip(narrow, buckets.widened([held for _, held in narrow], self.master_dtype)):
                self.records[i].final = grad
                grads.append(grad)
        if self.host_gradients is not None:
            for (i, _), grad in zip(unstaged, self.host_gradients.stage_gradients(unstaged)):
                self.records[i].final = grad
                grads.append(grad)
            self.host_gradients.gradients_ready()
        coefficient = scale / (self.world_size * self.replicas)
        if grads and coefficient != 1.0:
            buckets.scale_gradients(grads, coefficient, self.storage_runs or self.flat_runs, in_place)

    def consume(self, indices: Sequence[int]) -> None:
        everything = len(indices) == len(self.records)
        if everything and not self._holding:  # a window's start after a step that consumed them all
            return
        self._holding = not everything
        self.flat_runs = [] if everything else buckets.runs_without(self.flat_runs, indices)
        records = [self.records[i] for i in indices]
        for record in records:
            if not self.shard_gradients:
                record.param.grad = None
            record.state, record.produced, record.landed, record.final = GradState.EMPTY, False, False, None
            record.staged = record.own_rows = None
        if self.shard_gradients:
            # A bucket with nothing left unconsumed is overwritten by its next reduce-scatter; only buckets still
            # holding another optimizer's gradients need their consumed slices zeroed.
            holding = {
                b
                for b in {r.spec.bucket for r in records if r.shard is not None}
                if self._holds_sums(self.layout.buckets[b])
            }
            views = [r.shard for r in records if r.shard is not None and r.spec.bucket in holding]
            if views:
                torch._foreach_zero_(views)

    def _holds_sums(self, bucket: BucketSpec) -> bool:
        """Whether the next reduction must add to sums not yet consumed."""
        return any(self.records[i].landed for i in bucket.params)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def sum_over_replicas(
    group: dist.ProcessGroup | None,
    tensors: list[torch.Tensor],
    reduce_dtype: torch.dtype | None,
    compression: CompressedComm | None = None,
) -> None:
    """Sum ``tensors`` in place over ``group``, one flat all-reduce per dtype, in the same dtype as the shard group's
    reduce-scatter (e.g. fp32 for the fp16 sums of ``16-mixed``)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for held, same in by_dtype.items():
        flat = torch.cat([t.reshape(-1) for t in same]).to(comm_dtype(held, reduce_dtype))
        if compression is not None:
            compression.sum_over(flat, group, key=str(held).removeprefix("torch."))
        else:
            collectives.all_reduce(flat, group=group)
        torch._foreach_copy_(
            same, [part.view_as(t) for part, t in zip(torch.split(flat, [t.numel() for t in same]), same)]
        )


def comm_dtype(held: torch.dtype, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """Never narrower than the held gradients (fp32 layers of a mixed run)."""
    if reduce_dtype is None or held.itemsize > reduce_dtype.itemsize:
        return held
    return reduce_dtype
