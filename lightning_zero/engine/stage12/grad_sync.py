"""Gradient reduction for stages 1 and 2: post-accumulate-grad hooks fill rank-major buckets, each bucket is
reduce-scattered during backward once it and every earlier bucket are full, and this rank keeps only its shard. Each
bucket launches and lands its own reduction (``grad_bucket.py``); the reducer decides when, and what a step reads.

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
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.compression import CompressedComm
from lightning_zero.engine.comm.used_flags import UsedFlags
from lightning_zero.engine.offload.masters import MasterShards, master_dtype_of
from lightning_zero.engine.stage12 import buckets
from lightning_zero.engine.stage12.grad_bucket import BucketComm, GradBucket
from lightning_zero.engine.stage12.layout import ShardLayout
from lightning_zero.engine.stage12.zero_param import GradState, ZeroParam, produced_flags

#: Reductions allowed in flight before the oldest is landed; two keep the link busy while bounding memory.
MAX_BUCKETS_IN_FLIGHT = 2


class GradientReducer:
    """Reduce-scatters the gradients of the trainable parameters ``records`` hold (in layout order)."""

    def __init__(
        self,
        records: Sequence[ZeroParam],
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
        self.records = list(records)
        self.params = [record.param for record in self.records]
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
        self._next = 0  # the next bucket to launch (see [Note: every rank launches buckets in the same order])
        self._inflight: list[GradBucket] = []
        #: Whether a window's start has anything to clear.
        self._holding = False
        self.master_dtype = master_dtype
        self.host_gradients = host_gradients
        #: Not under hybrid sharding: :meth:`finalize` adds the replicas' sums first.
        self.stages_on_landing = host_gradients is not None and host_gradients.offloaded and self.replicas == 1
        self.on_landed: Callable[[int], None] | None = None
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.reduce_dtype = reduce_dtype
        comm = BucketComm(layout, self.params, rank, group, shard_gradients, compression, self.device)
        #: Each holds parameters of one dtype (see ``plan_layout(classes=...)``); stage 2's records view its storage.
        self.buckets = [
            GradBucket(
                spec,
                [self.records[i] for i in spec.params],
                dtype := self.params[spec.params[0]].dtype,
                comm_dtype(dtype, reduce_dtype),
                comm,
            )
            for spec in layout.buckets
        ]
        #: Flat buffers the sums are views of, so scaling is one op per buffer rather than per parameter.
        self.storage_runs = [(b.storage, b.spec.params) for b in self.buckets if b.storage is not None]
        self.flat_runs: list[tuple[torch.Tensor, Sequence[int]]] = []
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]

    @property
    def bucket_dtypes(self) -> list[torch.dtype]:
        return [bucket.dtype for bucket in self.buckets]

    # ------------------------------------------------------------------ views
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
        storage = [b.storage for b in self.buckets if b.storage is not None]
        return [*storage, *(r.final for r in self.records if r.final is not None)]

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
        bucket = self.buckets[record.spec.bucket]
        bucket.ready += 1
        if self.overlap_comm and bucket.index == self._next and bucket.full:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """[Note: every rank launches buckets in the same order]
        Concurrent reduce-scatters are matched by posting order alone, so a rank that launched bucket 1 before bucket 0
        (say, a parameter unused only on that rank) would pair its segments with another bucket's on its peers. Buckets
        are planned in the order gradients usually arrive, so launching in index order rarely delays one.
        """
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not bucket.full:
                return
            self._launch(bucket)

    def _launch(self, bucket: GradBucket) -> None:
        self._holding = True
        bucket.launch()
        self._next = bucket.index + 1
        self._inflight.append(bucket)
        if self._next == len(self.buckets):  # behind the last bucket's transfers: the flags are final now
            self.produced.start()
        # Bound the buffers alive at once, stage 2's below a whole gradient.
        while len(self._inflight) > MAX_BUCKETS_IN_FLIGHT:
            self._land(self._inflight.pop(0))

    def flush(self) -> None:
        """End of a synchronising backward: reduce the buckets that never filled (parameters unused on this rank
        contribute zeros) and land every shard."""
        if not self.require_sync:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        while self._inflight:
            self._land(self._inflight.pop(0))
        for bucket in self.buckets:
            bucket.restart()
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

    def _land(self, bucket: GradBucket) -> None:
        if flats := bucket.land():  # they replace the runs of an earlier backward of the window
            self.flat_runs = buckets.runs_without(self.flat_runs, (i for _, ix in flats for i in ix)) + flats
        self._landed(bucket)

    def _landed(self, bucket: GradBucket) -> None:
        """With the optimizer offloaded, the landed sums start for the host at once (see [Note: the offloaded step]
        in ``engine/offload/schedule.py``)."""
        if self.stages_on_landing and self.host_gradients is not None:
            held = [(r.index, g) for r in bucket.records if r.on_host and (g := self.local_grad(r.index)) is not None]
            for (i, _), copy in zip(held, self.host_gradients.stage_gradients(held)):
                self.records[i].staged = copy
            if self.on_landed is not None:  # see [Note: the host step during backward]
                self.on_landed(bucket.index)

    # ------------------------------------------------------------------ step
    def finalize(self, indices: Iterable[int], scale: float = 1.0) -> None:
        """Turn the held sums of ``indices`` into the averaged gradient, once."""
        if self._inflight or any(b.ready for b in self.buckets):
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
                b for b in {r.spec.bucket for r in records if r.shard is not None} if self.buckets[b].holds_sums()
            }
            views = [r.shard for r in records if r.shard is not None and r.spec.bucket in holding]
            if views:
                torch._foreach_zero_(views)

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
