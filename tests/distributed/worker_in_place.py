"""Rank program for test_collectives_in_place.py: stages 1-2's unpacked collectives (``reduce_in_place.py``,
``collectives.all_gather_in_place``) against the packed ones, on parameters whose rows do not split evenly,
with gradients missing on some ranks and sums held from an earlier backward; small pieces packed together
(every bucket here), and packed runs beside pieces that travel alone in one exchange (``mixed_pieces``)."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm import p2p_transport as p2p
from lightning_zero.engine.stage12.buckets import pack_bucket, segment_view
from lightning_zero.engine.stage12.layout import plan_layout
from lightning_zero.engine.stage12.param_gather import all_gather_params
from lightning_zero.engine.stage12.reduce_in_place import InPlaceReduction
from tests.launch import ensure_process_group, run_cases

#: Rows that split unevenly over 2 and 3 ranks, a 1-row parameter (some ranks hold none of it), a vector, an empty one.
SHAPES = [(7, 3), (5,), (1, 4), (10, 2), (4, 4), (0, 3)]


def _tensor(shape, rank: int, salt: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _layout(world: int, bucket_numel: int = 12):
    # Small buckets: several in flight at once, more than the two the reducer keeps before landing the oldest.
    return plan_layout([(f"p{i}", s) for i, s in enumerate(SHAPES)], world, bucket_numel=bucket_numel)


@contextlib.contextmanager
def mixed_pieces():
    """One bucket of every parameter, with small pieces packed and larger ones alone in one exchange: a piece
    of at most 24 bytes (6 fp32 elements) travels packed, so over 2 and 3 ranks the chunks of (5,) and (1, 4)
    are packed together and (7, 3) and (10, 2) go alone."""
    saved = p2p.PACK_PIECE_BYTES
    p2p.PACK_PIECE_BYTES = 24
    try:
        yield _layout(dist.get_world_size(), bucket_numel=1000)
    finally:
        p2p.PACK_PIECE_BYTES = saved


def _missing(rank: int, i: int) -> bool:
    """Parameter 1 has no gradient on rank 0 (an unused branch there)."""
    return rank == 0 and i == 1


def gradients(rank: int, salt: int) -> list[torch.Tensor | None]:
    return [None if _missing(rank, i) else _tensor(s, rank, salt) for i, s in enumerate(SHAPES)]


def _packed_reduction(layout, bucket_index: int, grads, group=None) -> torch.Tensor:
    bucket = layout.buckets[bucket_index]
    comm = pack_bucket(
        layout,
        bucket,
        [grads[i] if i in bucket.params else None for i in range(len(SHAPES))],
        torch.empty(bucket.numel),
    )
    out = torch.empty(bucket.segment_numel)
    collectives.reduce_scatter(out, comm, group=group)
    return out


def reductions(layout=None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = layout or _layout(world)
    report = {
        "buckets": len(layout.buckets),
        "stage2_max_diff": 0.0,
        "stage2_held_max_diff": 0.0,
        "stage1_max_diff": 0.0,
        "stage1_other_rows_zero": True,
        "grads_dropped": True,
    }
    first, second = gradients(rank, 1), gradients(rank, 2)
    for b, bucket in enumerate(layout.buckets):
        expected = _packed_reduction(layout, b, first)
        held_expected = expected + _packed_reduction(layout, b, second)
        # Stage 2: into an empty storage, then a second backward adds to the sums it holds.
        storage = torch.full((bucket.segment_numel,), float("nan"))
        params = [torch.nn.Parameter(torch.zeros(SHAPES[i])) for i in bucket.params]
        for held, grads, want, key in (
            (False, first, expected, "stage2_max_diff"),
            (True, second, held_expected, "stage2_held_max_diff"),
        ):
            for p, i in zip(params, bucket.params):
                p.grad = None if grads[i] is None else grads[i].clone()
            InPlaceReduction(layout, b, [p.grad for p in params], rank=rank, storage=storage, held=held).land(params)
            report["grads_dropped"] &= all(p.grad is None for p in params)
            for i in bucket.params:
                got, ref = segment_view(layout, storage, i, rank), segment_view(layout, want, i, rank)
                report[key] = max(report[key], (got - ref).abs().max().item() if got.numel() else 0.0)
        # Stage 1: the full p.grad stays, this rank's rows reduced and the others zeroed.
        for p, i in zip(params, bucket.params):
            p.grad = None if first[i] is None else first[i].clone()
        InPlaceReduction(layout, b, [p.grad for p in params], rank=rank).land(params)
        for p, i in zip(params, bucket.params):
            start, end = layout.params[i].element_range(rank)
            flat = p.grad.view(-1)
            ref = segment_view(layout, expected, i, rank).reshape(-1)
            report["stage1_max_diff"] = max(
                report["stage1_max_diff"], (flat[start:end] - ref).abs().max().item() if end > start else 0.0
            )
            report["stage1_other_rows_zero"] &= bool(flat[:start].eq(0).all() and flat[end:].eq(0).all())
    return _every_rank(report)


def _every_rank(report: dict) -> dict:
    """The worst of every rank's figures: the largest number, and a flag only where every rank has it."""
    reports = collectives.all_gather_objects(report)
    return {
        key: (all(r[key] for r in reports) if isinstance(value, bool) else max(r[key] for r in reports))
        for key, value in report.items()
    }


def gathers(layout=None) -> dict:
    """Every rank's rows of each parameter into every rank's parameters, counted as the packed collective is."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = layout or _layout(world)
    truth = [_tensor(s, 0, 7) for s in SHAPES]  # what every rank's rows together make
    params = [torch.nn.Parameter(torch.full(s, float("nan"))) for s in SHAPES]
    with torch.no_grad():
        for p, t, spec in zip(params, truth, layout.params):
            start, end = spec.element_range(rank)
            p.view(-1)[start:end] = t.view(-1)[start:end]
    collectives.comm_stats().reset()
    all_gather_params(layout, params, range(len(layout.buckets)), rank=rank)
    counted = collectives.comm_stats().snapshot()
    return _every_rank(
        {
            "in_place": collectives.exchanges_in_place(),
            "equal": all(torch.equal(p.detach(), t) for p, t in zip(params, truth)),
            "counted_elements": counted["elements_by_kind"].get("all_gather", 0),
            "packed_elements": sum(b.numel for b in layout.buckets),
            "calls": counted["calls"].get("all_gather", 0),
        }
    )


def mixed_reductions() -> dict:
    with mixed_pieces() as layout:
        return reductions(layout)


def mixed_gathers() -> dict:
    with mixed_pieces() as layout:
        return gathers(layout)


def unused_bf16_bucket() -> dict:
    """Stage 1, a bf16 bucket none of whose parameters has a gradient on rank 0 (an expert it routed nothing to): it
    still sends what the others expect, runs decided by the bucket's dtype (a bf16 piece of 24 bytes travels packed,
    an fp32 one of the same rows alone), and every rank's rows hold the others' sums."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with mixed_pieces() as layout:
        (bucket,) = layout.buckets
        params = [torch.nn.Parameter(torch.zeros(SHAPES[i], dtype=torch.bfloat16)) for i in bucket.params]
        for p in params:
            p.grad = None if rank == 0 else torch.full(p.shape, float(rank), dtype=torch.bfloat16)
        InPlaceReduction(layout, 0, [p.grad for p in params], rank=rank, dtype=torch.bfloat16).land(params)
    expected = float(sum(range(1, world)))
    own_rows = [p.grad.view(-1)[slice(*layout.params[i].element_range(rank))] for i, p in zip(bucket.params, params)]
    return _every_rank({"own_rows_are_the_sum": all(bool(r.eq(expected).all()) for r in own_rows)})


if __name__ == "__main__":
    ensure_process_group()
    cases = {
        "reductions": reductions,
        "gathers": gathers,
        "mixed_reductions": mixed_reductions,
        "mixed_gathers": mixed_gathers,
        "unused_bf16_bucket": unused_bf16_bucket,
    }
    run_cases(cases, sys.argv[1:])
