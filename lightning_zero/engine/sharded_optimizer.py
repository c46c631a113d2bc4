"""The user's optimizer, stepping only this rank's shard of every parameter (stages 1 and 2).

[Note: re-hosting without replacing the optimizer]
The optimizer object the user built stays the one Lightning, LR schedulers and ``toggle_optimizer`` see:
its ``param_groups`` keep the real parameters. For the duration of ``step`` each trainable parameter in
``param_groups`` is swapped for a persistent *view* of this rank's rows of it (its gradient set to this
rank's reduced gradient shard), so the optimizer reads and writes shard-sized tensors and keys its state
by those views: optimizer state is born sharded and never exists at full size. Because the views alias the
resident parameters, no fp32 master copy exists; after the step the updated rows are all-gathered back
into every rank's parameters.

Under a mixed-precision policy the hosted tensors are instead this rank's fp32 *master* rows (owned by the
engine, see ``mixed_precision.py``); after the step they are cast into the resident 2-byte parameters'
rows, which are then all-gathered in that dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine import collectives
from lightning_zero.engine.buckets import local_rows, pack_segment, unpack_bucket
from lightning_zero.engine.grad_sync import MAX_BUCKETS_IN_FLIGHT, GradientReducer
from lightning_zero.engine.layout import ShardLayout

#: Optimizers whose update of an element depends only on that element's gradient and state, so stepping
#: each rank's shard separately equals stepping the whole tensor.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD")
    if hasattr(torch.optim, name)
)
#: Optimizers known to couple elements (line searches, factored or matrix-wise statistics, sparse updates).
NON_ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam", "Adafactor", "Muon") if hasattr(torch.optim, name)
)


def check_elementwise(optimizer: Optimizer, stage: int, extra: tuple[type, ...] = ()) -> None:
    """Refuse optimizers whose sharded step could differ from the unsharded one: known non-element-wise
    ones, and any class neither we nor the user (``elementwise_optimizers=``) vouch for, since per-tensor
    statistics (LAMB's trust ratio, Shampoo's preconditioners) are silently wrong on shards."""
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS + tuple(extra)) and not isinstance(optimizer, NON_ELEMENTWISE_OPTIMIZERS):
        return
    allowed = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise TypeError(
        f"ZeroStrategy(stage={stage}) cannot shard `{type(optimizer).__name__}`: each rank steps only its own "
        f"shard of every parameter, which is exact only for element-wise optimizers. Use one of {allowed} "
        "(or a subclass), or, if your optimizer updates every element independently, pass "
        f"`ZeroStrategy(elementwise_optimizers=({type(optimizer).__name__},))`."
    )


class ShardedOptimizer:
    """Steps ``optimizer`` on this rank's shards and all-gathers the updated parameters."""

    def __init__(
        self,
        optimizer: Optimizer,
        params: Sequence[nn.Parameter],
        layout: ShardLayout,
        reducer: GradientReducer,
        *,
        rank: int,
        masters: Sequence[torch.Tensor] | None = None,
        group=None,
    ) -> None:
        self.optimizer = optimizer
        self.masters = masters
        self.layout = layout
        self.reducer = reducer
        self.rank = rank
        self.group = group
        self.params = list(params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        #: Persistent shard views (stable identity: the optimizer keys its state by them).
        self.shards: dict[int, torch.Tensor] = {}
        self.refresh()

    def refresh(self) -> None:
        """Follow ``param_groups`` (callbacks such as ``BackboneFinetuning`` add groups during training)."""
        indices = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                i = self._index.get(id(p))
                if i is None:
                    if p.requires_grad:
                        raise RuntimeError(
                            f"A parameter of shape {tuple(p.shape)} in {type(self.optimizer).__name__}'s param_groups "
                            "was frozen (or not part of the model) when ZeroStrategy set up, so it has no shard and "
                            "no gradient reduction. Unfreeze parameters before `fit`, or freeze them with "
                            "`requires_grad=False` for the whole run."
                        )
                    continue
                indices.append(i)
                if i not in self.shards:
                    self.shards[i] = (
                        self.masters[i]
                        if self.masters is not None
                        else local_rows(self.params[i].detach(), self.layout.params[i], self.rank)
                    )
        #: Layout indices of the trainable parameters this optimizer owns, in param_groups order.
        self.indices = indices
        self.buckets = sorted({self.layout.params[i].bucket for i in indices})

    @contextlib.contextmanager
    def hosted_on_shards(self) -> Iterator[None]:
        """Swap trainable parameters in ``param_groups`` for their shard views (see the module note)."""
        saved = [group["params"] for group in self.optimizer.param_groups]
        try:
            for group in self.optimizer.param_groups:
                hosted = []
                for p in group["params"]:
                    i = self._index.get(id(p))
                    if i is None:
                        hosted.append(p)
                        continue
                    shard = self.shards[i]
                    shard.grad = self.reducer.local_grad(i)
                    hosted.append(shard)
                group["params"] = hosted
            yield
        finally:
            for group, params in zip(self.optimizer.param_groups, saved):
                group["params"] = params
            for shard in self.shards.values():
                shard.grad = None

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's gradient shards (for the global norm)."""
        grads = (self.reducer.local_grad(i) for i in self.indices)
        return [g for g in grads if g is not None]

    def step(self, **kwargs) -> object:
        self.refresh()
        self.reducer.finalize(self.indices)
        with self.hosted_on_shards():
            result = self.optimizer.step(**kwargs)
        self.reducer.consume(self.indices)
        self.all_gather_params()
        return result

    def discard_gradients(self) -> None:
        """A skipped step: drop the gradients as the step would have consumed them."""
        self.reducer.consume(self.indices)

    def all_gather_params(self) -> None:
        if self.masters is not None:
            copy_masters_to_params(self.layout, self.params, self.masters, self.indices, rank=self.rank)
        all_gather_params(self.layout, self.params, self.buckets, rank=self.rank, group=self.group)


def copy_masters_to_params(
    layout: ShardLayout, params: Sequence[nn.Parameter], masters: Sequence[torch.Tensor], indices, *, rank: int
) -> None:
    """Cast this rank's updated master rows into its rows of the resident parameters."""
    with torch.no_grad():
        for i in indices:
            local_rows(params[i].detach(), layout.params[i], rank).copy_(masters[i])


def all_gather_params(layout: ShardLayout, params: Sequence[nn.Parameter], buckets: Sequence[int], *, rank: int, group=None) -> None:
    """Bring every rank's rows of ``params`` into the resident parameters, one bucket at a time,
    overlapping the packing of the next bucket with the in-flight gather of the previous one."""
    if layout.world_size == 1:
        return
    flights: list = []
    sources = [p.detach() for p in params]

    def land(bucket, work, full) -> None:
        if work is not None:
            work.wait()
        with torch.no_grad():
            unpack_bucket(layout, bucket, full, sources, skip_rank=rank)  # own rows are already in place

    for b in buckets:
        bucket = layout.buckets[b]
        like = sources[bucket.params[0]]  # a bucket holds one dtype
        segment = pack_segment(
            layout, bucket, rank, sources, torch.empty(bucket.segment_numel, dtype=like.dtype, device=like.device)
        )
        full = torch.empty(bucket.numel, dtype=segment.dtype, device=segment.device)
        flights.append((bucket, collectives.all_gather(full, segment, group=group, async_op=True), full))
        if len(flights) > MAX_BUCKETS_IN_FLIGHT:  # bound the full-size buffers alive at once
            land(*flights.pop(0))
    for flight in flights:
        land(*flight)
