"""The shard arithmetic and bucket copies, without processes."""

import math

import pytest
import torch

from lightning_zero.engine.comm import p2p_transport
from lightning_zero.engine.shard import local_rows
from lightning_zero.engine.stage12.buckets import (
    pack_bucket,
    pack_segment,
    rows_by_rank,
    scale_gradients,
    segment_parts,
    segment_view,
    unpack_bucket,
    widened,
)
from lightning_zero.engine.stage12.layout import plan_layout
from lightning_zero.engine.stage12.param_gather import RowViews
from lightning_zero.engine.stage12.reduce_in_place import param_order_index, transfer_runs

SHAPES = [("emb", (10, 3)), ("w", (7, 5)), ("b", (7,)), ("tiny", (1,)), ("scalar", ())]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_partition_every_parameter_like_torch_chunk(world):
    layout = plan_layout(SHAPES, world, bucket_numel=10**9)
    for spec in layout.params:
        covered = [spec.row_range(r) for r in range(world)]
        rows = [r for start, end in covered for r in range(start, end)]
        assert rows == list(range(spec.rows)), spec.name
        if spec.shape:  # FSDP2 shards with torch.chunk; our rows must match it
            chunks = torch.empty(spec.shape).chunk(world)
            sizes = [c.shape[0] for c in chunks] + [0] * (world - len(chunks))
            assert [end - start for start, end in covered] == sizes


def test_buckets_close_at_the_size_limit_in_reverse_order():
    layout = plan_layout(SHAPES, 2, bucket_numel=40)
    order = [i for b in layout.buckets for i in b.params]
    assert order == [4, 3, 2, 1, 0]
    assert all(b.numel >= 40 for b in layout.buckets[:-1])
    for b in layout.buckets:
        assert b.segment_numel == sum(layout.params[i].chunk_numel for i in b.params)
    assert layout.padded_numel >= layout.total_numel
    assert "bucket 0" in layout.describe(rank=1)


def _packed_buckets(world: int):
    """``(layout, tensors, bucket, packed buffer)`` for every bucket of SHAPES' layout over ``world`` ranks; the
    buffers start as NaN, so padding the packing leaves unwritten shows."""
    torch.manual_seed(0)
    layout = plan_layout(SHAPES, world, bucket_numel=64)
    tensors = [torch.randn(shape) for _, shape in SHAPES]
    for bucket in layout.buckets:
        yield layout, tensors, bucket, pack_bucket(layout, bucket, tensors, torch.full((bucket.numel,), float("nan")))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pack_then_reduce_scatter_segments_hold_each_ranks_rows(world):
    for layout, tensors, bucket, buf in _packed_buckets(world):
        assert not buf.isnan().any(), "padding must be zeroed"
        for rank in range(world):
            segment = buf.view(world, -1)[rank]
            for i in bucket.params:
                start, end = layout.params[i].row_range(rank)
                expected = tensors[i].view(1)[start:end] if tensors[i].dim() == 0 else tensors[i][start:end]
                assert torch.equal(segment_view(layout, segment, i, rank), expected)
                assert torch.equal(local_rows(tensors[i], rank, world), expected)
        # all-gather input (one segment per rank) reassembles the same buffer; unpack restores the tensors
        gathered = torch.cat(
            [pack_segment(layout, bucket, r, tensors, torch.empty(bucket.segment_numel)) for r in range(world)]
        )
        assert torch.equal(gathered, buf)
        restored = [torch.zeros(shape) for _, shape in SHAPES]
        unpack_bucket(layout, bucket, gathered, restored)
        for i in bucket.params:
            assert torch.equal(restored[i], tensors[i])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_split_gives_every_ranks_rows_and_every_segment_part(world):
    for layout, tensors, bucket, buf in _packed_buckets(world):
        for rank in range(world):
            parts = segment_parts(buf.view(world, -1)[rank], layout, bucket.index, rank)
            for j, i in enumerate(bucket.params):
                rows = rows_by_rank(tensors[i].view(-1), layout.params[i])
                assert torch.equal(rows[rank], local_rows(tensors[i], rank, world).reshape(-1))
                assert torch.equal(parts[j], rows[rank])
                assert parts[j].data_ptr() == segment_view(layout, buf.view(world, -1)[rank], i, rank).data_ptr()


def test_row_views_are_kept_until_a_parameter_gets_new_memory():
    layout = plan_layout(SHAPES[:3], 2, bucket_numel=10**9)
    params = [torch.nn.Parameter(torch.randn(shape)) for _, shape in SHAPES[:3]]
    views, bucket = RowViews(layout), layout.buckets[0]
    first = views.of_bucket(bucket, params)
    assert views.of_bucket(bucket, params) is first
    for rank, of_rank in enumerate(first):
        for j, i in enumerate(bucket.params):
            assert torch.equal(of_rank[j], local_rows(params[i].detach(), rank, 2).reshape(-1))
    moved = bucket.params[1]
    params[moved].data = params[moved].data.clone()  # e.g. a checkpoint loaded by assignment, or `.to()`
    again = views.of_bucket(bucket, params)
    assert again is not first
    assert again[1][1].data_ptr() == local_rows(params[moved].detach(), 1, 2).data_ptr()


def test_none_sources_pack_as_zeros():
    layout = plan_layout(SHAPES, 2, bucket_numel=10**9)
    bucket = layout.buckets[0]
    buf = pack_bucket(layout, bucket, [None] * len(SHAPES), torch.ones(bucket.numel))
    assert torch.count_nonzero(buf) == 0


def test_shard_numel_is_a_world_size_fraction_of_padded_total():
    layout = plan_layout(SHAPES, 4, bucket_numel=16)
    assert layout.shard_numel * 4 == layout.padded_numel
    assert layout.padded_numel - layout.total_numel < sum(math.prod(s[1:]) * 4 for _, s in SHAPES if s) + 4


@pytest.mark.parametrize("world", [2, 3])
def test_unpack_can_leave_one_ranks_rows_alone(world):
    torch.manual_seed(1)
    layout = plan_layout(SHAPES, world, bucket_numel=10**9)
    bucket = layout.buckets[0]
    tensors = [torch.randn(shape) for _, shape in SHAPES]
    full = pack_bucket(layout, bucket, tensors, torch.empty(bucket.numel))
    for skip in range(world):
        targets = [torch.full(shape, 7.0) for _, shape in SHAPES]
        unpack_bucket(layout, bucket, full, targets, skip_rank=skip)
        for i in bucket.params:
            spec = layout.params[i]
            for rank in range(world):
                got = local_rows(targets[i], rank, world)
                want = torch.full_like(got, 7.0) if rank == skip else local_rows(tensors[i], rank, world)
                assert torch.equal(got, want), (spec.name, rank, skip)


def test_small_pieces_travel_in_runs_and_large_ones_alone():
    """[Note: collectives in place]: runs are decided from padded chunk lengths alone (the same on every rank), so
    every rank posts the same transfers."""
    small = p2p_transport.PACK_PIECE_BYTES // 4  # fp32 elements of the largest packed piece
    assert p2p_transport.packed_runs([], 4) == []
    assert p2p_transport.packed_runs([3, 0, small], 4) == [(0, 3)]
    assert p2p_transport.packed_runs([small + 1, 3, 5, small + 1, 7], 4) == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert p2p_transport.packed_runs([small + 1, small + 1], 2) == [(0, 2)]  # bf16: twice the elements fit


@pytest.mark.parametrize("world", [2, 3, 4])
def test_chunk_cat_packs_a_run_of_gradients_exactly_as_the_bucket_lays_them_out(world):
    """[Note: small gradients travel as runs]: ``torch._chunk_cat`` of a run's gradients is the run's slice of the
    rank-major bucket (uneven rows, a one-row parameter, a scalar), and the run's index puts it back in parameter
    order."""
    layout = plan_layout(SHAPES, world, bucket_numel=10**9)
    bucket = layout.buckets[0]
    grads = [torch.randn(layout.params[i].shape) for i in bucket.params]
    (run,) = transfer_runs(layout, 0, 4)
    assert run.packed and (run.start, run.end, run.low, run.high) == (0, len(grads), 0, bucket.segment_numel)
    packed = torch._chunk_cat([g.view(1) if g.dim() == 0 else g for g in grads], 0, world)
    full = {i: g for i, g in zip(bucket.params, grads)}
    expected = pack_bucket(layout, bucket, [full.get(i) for i in range(len(SHAPES))], torch.empty(bucket.numel))
    assert torch.equal(packed.reshape(-1), expected)
    index = param_order_index(layout, 0, run, torch.device("cpu"))
    assert torch.equal(packed.view(-1).index_select(0, index), torch.cat([g.reshape(-1) for g in grads]))
    assert transfer_runs(layout, 0, 4) is transfer_runs(layout, 0, 4)  # kept with the layout


def test_an_average_scales_each_buffer_holding_only_gradients_of_this_step_once_and_the_rest_one_by_one():
    held, other = torch.ones(6), torch.ones(4)
    a, b, c = held[:2], held[2:6], other[:4]  # ``held``: every gradient in it is finalized now
    lone = torch.ones(3)
    scale_gradients([a, b, lone, c], 0.5, [(held, [0, 1]), (other, [2, 3])], {0: a, 1: b, 2: c})  # 3 is not
    assert held.eq(0.5).all() and lone.eq(0.5).all() and c.eq(0.5).all()  # ``other``'s view scaled alone, once


def test_narrow_sums_widen_into_views_of_one_buffer_with_their_values():
    sums = [
        torch.randn(4, 3, dtype=torch.bfloat16),
        torch.randn(0, dtype=torch.bfloat16),
        torch.randn(5, dtype=torch.bfloat16),
    ]
    wide = widened(sums, torch.float32)
    assert [w.shape for w in wide] == [s.shape for s in sums] and {w.dtype for w in wide} == {torch.float32}
    assert all(torch.equal(w, s.float()) for w, s in zip(wide, sums))
    assert wide[2].untyped_storage().data_ptr() == wide[0].untyped_storage().data_ptr()
