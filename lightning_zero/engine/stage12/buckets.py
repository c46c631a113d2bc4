"""Copies between per-parameter tensors and rank-major bucket buffers (see [Note: rank-major buckets]).

Each function does one strided copy per parameter: a bucket viewed as ``[world_size, segment]`` has
parameter ``p``'s chunks in the column block ``[offset, offset + chunk)``, and a parameter's first
``full_chunks`` chunks are exactly ``flat[: full_chunks * chunk].view(full_chunks, chunk)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from lightning_zero.engine.stage12.layout import BucketSpec, ParamShardSpec, ShardLayout
from lightning_zero.torch_versions.tensors import flatten_dense_tensors, unflatten_dense_tensors


def _columns(buffer: torch.Tensor, bucket: BucketSpec, spec: ParamShardSpec) -> torch.Tensor:
    grid = buffer.view(bucket.world_size, bucket.segment_numel)
    return grid[:, spec.offset : spec.offset + spec.chunk_numel]


def pack_bucket(
    layout: ShardLayout, bucket: BucketSpec, sources: Sequence[torch.Tensor | None], out: torch.Tensor
) -> torch.Tensor:
    """``None`` sources and padding are zeroed."""
    for i in bucket.params:
        spec = layout.params[i]
        cols = _columns(out, bucket, spec)
        source = sources[i]
        if source is None:
            cols.zero_()
            continue
        flat = source.reshape(-1)
        k, c = spec.full_chunks, spec.chunk_numel
        if k:
            cols[:k].copy_(flat[: k * c].view(k, c))
        if k < bucket.world_size:
            rest = spec.numel - k * c
            tail = cols[k:]
            if rest:
                tail[0, :rest].copy_(flat[k * c :])
                tail[0, rest:].zero_()
                tail[1:].zero_()
            else:
                tail.zero_()
    return out


def unpack_bucket(
    layout: ShardLayout,
    bucket: BucketSpec,
    full: torch.Tensor,
    targets: Sequence[torch.Tensor],
    skip_rank: int | None = None,
) -> None:
    """Inverse of :func:`pack_bucket`, leaving out ``skip_rank``'s chunk, which the target already holds."""
    for i in bucket.params:
        spec = layout.params[i]
        cols = _columns(full, bucket, spec)
        flat = targets[i].view(-1)
        for start, end in _row_blocks(spec, skip_rank):
            flat[start * spec.chunk_numel : end * spec.chunk_numel].view(end - start, spec.chunk_numel).copy_(
                cols[start:end]
            )
        rest = spec.numel - spec.full_chunks * spec.chunk_numel
        if rest and spec.full_chunks != skip_rank:
            k = spec.full_chunks
            flat[k * spec.chunk_numel :].copy_(cols[k, :rest])


def _row_blocks(spec: ParamShardSpec, skip_rank: int | None) -> list[tuple[int, int]]:
    k = spec.full_chunks
    if skip_rank is None or skip_rank >= k:
        return [(0, k)] if k else []
    return [(a, b) for a, b in ((0, skip_rank), (skip_rank + 1, k)) if b > a]


def pack_segment(
    layout: ShardLayout, bucket: BucketSpec, rank: int, sources: Sequence[torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    for i in bucket.params:
        spec = layout.params[i]
        start, end = spec.element_range(rank)
        dst = out[spec.offset : spec.offset + spec.chunk_numel]
        dst[: end - start].copy_(sources[i].reshape(-1)[start:end])
        dst[end - start :].zero_()
    return out


def segment_view(layout: ShardLayout, segment: torch.Tensor, index: int, rank: int) -> torch.Tensor:
    spec = layout.params[index]
    start, end = spec.row_range(rank)
    numel = (end - start) * spec.row_numel
    view = segment[spec.offset : spec.offset + numel]
    return view.view(end - start, *spec.shape[1:]) if spec.shape else view


def rows_by_rank(flat: torch.Tensor, spec: ParamShardSpec) -> tuple[torch.Tensor, ...]:
    """One ``split``: the per-step cost of views is paid per parameter, not per parameter and rank."""
    return tuple(flat.split_with_sizes(spec.rank_numels))


def segment_parts(segment: torch.Tensor, layout: ShardLayout, bucket_index: int, rank: int) -> list[torch.Tensor]:
    return list(segment.split_with_sizes(layout.segment_split(bucket_index, rank))[::2])


def land_in_own_rows(
    layout: ShardLayout, bucket_index: int, params: Sequence[torch.nn.Parameter], segment: torch.Tensor, rank: int
) -> None:
    """Stage 1's landing of a packed reduction: the other rows restart from zero (see
    [Note: gradients are held as sums until finalized] in ``grad_sync.py``)."""
    own: list[torch.Tensor] = []
    others: list[torch.Tensor] = []
    for i in layout.buckets[bucket_index].params:
        param = params[i]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        rows = rows_by_rank(param.grad.view(-1), layout.params[i])
        own.append(rows[rank])
        others.extend(part for r, part in enumerate(rows) if r != rank and part.numel())
    torch._foreach_copy_(own, segment_parts(segment, layout, bucket_index, rank))
    if others:
        torch._foreach_zero_(others)


def widened(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """As views of one flat buffer: three calls whatever their number, not a dispatch per tensor."""
    return list(unflatten_dense_tensors(flatten_dense_tensors(list(tensors)).to(dtype), list(tensors)))


def runs_without(
    runs: Sequence[tuple[torch.Tensor, Sequence[int]]], indices: Iterable[int]
) -> list[tuple[torch.Tensor, Sequence[int]]]:
    if not runs:
        return []
    gone = set(indices)
    return [run for run in runs if gone.isdisjoint(run[1])]


def scale_gradients(
    grads: Sequence[torch.Tensor],
    coefficient: float,
    buffers: Sequence[tuple[torch.Tensor, Sequence[int]]],
    in_place: Mapping[int, torch.Tensor],
) -> None:
    """A flat buffer at a time where one holds only gradients of ``in_place`` (the rest of it being padding or, at stage
    1, other ranks' zero rows), one kernel for it; the others through one ``foreach``."""
    scaled: set[int] = set()
    for flat, indices in buffers:
        if all(i in in_place and in_place[i]._base is flat for i in indices):
            flat.mul_(coefficient)
            scaled.update(id(in_place[i]) for i in indices)
    rest = [g for g in grads if id(g) not in scaled] if scaled else list(grads)
    if rest:
        torch._foreach_mul_(rest, coefficient)
