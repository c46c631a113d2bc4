"""Pure arithmetic of the shard convention: which rows of which parameter each rank owns, and how parameters are packed
into communication buckets. The rule is ``shard.py``'s ([Note: one shard convention for every stage]). Rows, chunk,
bucket, segment: [Note: vocabulary] in ``engine/__init__.py``.

[Note: rank-major buckets]
``reduce_scatter_tensor`` hands rank ``r`` the ``r``-th contiguous segment of its input, and
``all_gather_into_tensor`` concatenates one segment per rank. A bucket is therefore laid out rank-major: segment
``r`` holds chunk ``r`` of every parameter of the bucket, each padded to the full chunk length, at the same offset in
every segment. Packing a gradient into a bucket is one strided copy per parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy

from lightning_zero.engine import shard


@dataclasses.dataclass(frozen=True)
class ParamShardSpec:
    """Where one parameter's chunks live."""

    index: int
    name: str
    shape: tuple[int, ...]
    world_size: int
    bucket: int
    offset: int
    """Of this parameter's chunk inside each rank segment of its bucket."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return shard.dim0_rows(self.shape)

    @property
    def row_numel(self) -> int:
        return shard.row_numel(self.shape)

    @functools.cached_property
    def chunk_numel(self) -> int:
        return shard.chunk_numel(self.shape, self.world_size)

    def row_range(self, rank: int) -> tuple[int, int]:
        return self._row_ranges[rank]

    def element_range(self, rank: int) -> tuple[int, int]:
        return self._element_ranges[rank]

    def local_numel(self, rank: int) -> int:
        start, end = self.element_range(rank)
        return end - start

    # Asked per parameter in every step's reduction and gather (``cached_property`` writes the instance dict directly,
    # which a frozen dataclass allows).
    @functools.cached_property
    def _row_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(shard.row_range(self.shape, r, self.world_size) for r in range(self.world_size))

    @functools.cached_property
    def _element_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(shard.element_range(self.shape, r, self.world_size) for r in range(self.world_size))

    @functools.cached_property
    def rank_numels(self) -> list[int]:
        """They tile the flattened parameter, so one ``split`` by them gives every rank's rows at once."""
        return [end - start for start, end in self._element_ranges]

    @property
    def full_chunks(self) -> int:
        return self.numel // self.chunk_numel if self.chunk_numel else 0


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """One communication bucket: a rank-major buffer of ``world_size`` segments."""

    index: int
    params: tuple[int, ...]
    segment_numel: int
    world_size: int

    @property
    def numel(self) -> int:
        return self.segment_numel * self.world_size


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    params: tuple[ParamShardSpec, ...]
    buckets: tuple[BucketSpec, ...]
    world_size: int

    @property
    def total_numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def padded_numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        return sum(b.segment_numel for b in self.buckets)

    def segment_split(self, bucket_index: int, rank: int) -> list[int]:
        """Sizes that ``split`` a rank segment into, alternately, each parameter's rows and its padding."""
        key = (bucket_index, rank)
        sizes = self._segment_splits.get(key)
        if sizes is None:
            sizes = []
            for i in self.buckets[bucket_index].params:
                spec = self.params[i]
                local = spec.rank_numels[rank]
                sizes += [local, spec.chunk_numel - local]
            self._segment_splits[key] = sizes
        return sizes

    @functools.cached_property
    def _segment_splits(self) -> dict[tuple[int, int], list[int]]:
        return {}

    @functools.cached_property
    def memo(self) -> dict[tuple[object, ...], Any]:
        """What every step derives from the plan alone, kept with the plan it was derived from."""
        return {}

    def describe(self, rank: int = 0) -> str:
        lines = [
            f"ShardLayout: {len(self.params)} params, {self.total_numel:,} elements, "
            f"{len(self.buckets)} buckets, world_size={self.world_size}, "
            f"padding={self.padded_numel - self.total_numel:,} elements"
        ]
        for bucket in self.buckets:
            lines.append(f"  bucket {bucket.index}: {bucket.numel:,} elements ({bucket.segment_numel:,} per rank)")
            for i in bucket.params:
                p = self.params[i]
                start, end = p.row_range(rank)
                lines.append(
                    f"    {p.name} {list(p.shape)}: offset {p.offset}, chunk {p.chunk_numel}, "
                    f"rank {rank} rows [{start}, {end})"
                )
        return "\n".join(lines)


def plan_layout(
    named_shapes: Sequence[tuple[str, Sequence[int]]],
    world_size: int,
    bucket_numel: int,
    classes: Sequence[int] | None = None,
) -> ShardLayout:
    """Assign parameters to buckets in reverse order, as gradients arrive roughly last layer first (as DDP assumes).
    ``classes`` keeps parameters of different classes (dtypes) out of each other's buckets."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    classes = list(classes) if classes is not None else [0] * len(named_shapes)
    if len(classes) != len(named_shapes):
        raise ValueError(f"got {len(classes)} classes for {len(named_shapes)} parameters")

    order = sorted(reversed(range(len(named_shapes))), key=lambda i: classes[i])  # stable: reverse order within a class
    assignments: dict[int, tuple[int, int]] = {}
    buckets: list[BucketSpec] = []
    current: list[int] = []
    segment = 0

    def close() -> None:
        nonlocal current, segment
        if current:
            buckets.append(BucketSpec(len(buckets), tuple(current), segment, world_size))
        current, segment = [], 0

    for i in order:
        if current and classes[current[-1]] != classes[i]:
            close()
        _, shape = named_shapes[i]
        probe = ParamShardSpec(i, "", tuple(shape), world_size, 0, 0)
        assignments[i] = (len(buckets), segment)
        current.append(i)
        segment += probe.chunk_numel
        if segment * world_size >= bucket_numel:
            close()
    close()

    params = tuple(
        ParamShardSpec(i, name, tuple(shape), world_size, *assignments[i])
        for i, (name, shape) in enumerate(named_shapes)
    )
    return ShardLayout(params, tuple(buckets), world_size)


def check_initialized(module: nn.Module) -> None:
    lazy = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if is_lazy(t)]
    if lazy:
        shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
        raise ValueError(
            f"ZeroStrategy cannot shard {shown}: uninitialized (a lazy layer such as `nn.LazyLinear`, whose shape is "
            "known only after its first forward). Run one forward on a sample batch before `fit`, e.g. at the end "
            "of `__init__` or in `configure_model`, as Lightning's `ddp` also requires."
        )


def check_trainable(module: nn.Module) -> None:
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"ZeroStrategy found no trainable parameters in {type(module).__name__}: every parameter has "
            "`requires_grad=False` (or the model has none). Build the layers in `__init__` or `configure_model`, "
            "and leave at least one parameter trainable."
        )
