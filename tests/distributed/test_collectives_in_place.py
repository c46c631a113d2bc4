"""Stages 1-2 over gloo reduce gradients out of ``p.grad`` and gather rows into the parameters without packed
buffers ([Note: collectives in place] in ``engine/comm/collectives.py``): the same sums as the packed reduce-scatter
(bit for bit on 2 ranks, where a two-term sum has one order), every rank's rows in every parameter, and the
counters of the packed collectives. 3 ranks: rows that split unevenly, ranks that hold none of a parameter,
several peers' contributions."""

from __future__ import annotations

import pytest

from tests.launch import launch


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def report(request):
    return {
        "world": request.param,
        **launch(
            "tests.distributed.worker_in_place",
            "reductions",
            "gathers",
            "mixed_reductions",
            "mixed_gathers",
            "unused_bf16_bucket",
            nprocs=request.param,
        ),
    }


@pytest.mark.parametrize("pieces", ["", "mixed_"], ids=["small_pieces_packed", "packed_and_alone"])
def test_reductions_equal_the_packed_reduce_scatter(report, pieces):
    reductions = report[pieces + "reductions"]
    assert reductions["buckets"] >= (3 if not pieces else 1)  # more than the reducer keeps in flight
    tolerance = 0.0 if report["world"] == 2 else 1e-6  # 3 ranks: the ring sums in another order
    assert reductions["stage2_max_diff"] <= tolerance
    assert reductions["stage2_held_max_diff"] <= tolerance
    assert reductions["stage1_max_diff"] <= tolerance
    assert reductions["stage1_other_rows_zero"]
    assert reductions["grads_dropped"]  # stage 2 keeps no full gradient once its bucket has landed


@pytest.mark.parametrize("pieces", ["", "mixed_"], ids=["small_pieces_packed", "packed_and_alone"])
def test_gathers_fill_every_parameter_and_count_as_the_packed_collective(report, pieces):
    gathers = report[pieces + "gathers"]
    assert gathers["in_place"]
    assert gathers["equal"]
    assert gathers["counted_elements"] == gathers["packed_elements"]
    assert gathers["calls"] == report[pieces + "reductions"]["buckets"]


def test_a_rank_with_no_gradient_in_a_bf16_bucket_sends_the_runs_the_others_expect(report):
    assert report["unused_bf16_bucket"]["own_rows_are_the_sum"]
