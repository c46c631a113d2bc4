"""Shared-memory collectives (``engine/comm/shm_transport.py``, opt-in with ``LIGHTNING_ZERO_SHM_COLLECTIVES=1``):
exact, in rank order, chunked through mailboxes smaller than the data, per process group, no file left in
/dev/shm, and training through them at every stage equals plain PyTorch (test_core's exactness cases). `make test`
runs the 2-rank collectives; 4 ranks (sub-groups) and the training cases are in `make test-all`."""

from __future__ import annotations

import pytest

from tests.launch import launch

SHM = {"LIGHTNING_ZERO_SHM_COLLECTIVES": "1"}


@pytest.fixture(
    scope="module",
    params=[2, pytest.param(4, marks=[pytest.mark.full, pytest.mark.many_ranks])],
    ids=["2ranks", "4ranks"],
)
def report(request):
    return launch("tests.distributed.worker_shm", "collectives", nprocs=request.param, env=SHM)["collectives"]


def test_mailboxes_serve_one_host_groups(report):
    assert report["world_served"]
    if "pair" in report:
        assert report["pair_served"]


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_all_gather_and_reduce_scatter_are_exact(report, dtype):
    case = report[f"world_{dtype}"]
    assert case["gather_equal"]
    assert case["reduce_equal_rank_order"]  # summed in rank order, the same on every rank
    assert case["reduce_vs_ring"] <= (1e-6 if dtype == "torch.float32" else 0.05)


def test_sub_groups_have_their_own_mailboxes(report):
    if "pair" not in report:
        pytest.skip("4 ranks only")
    assert report["pair"]["gather_equal"] and report["pair"]["reduce_equal_rank_order"]


def test_no_file_is_left_in_dev_shm(report):
    assert report["files_left"] == []


@pytest.fixture(scope="module")
def exact():
    return launch("tests.distributed.worker_core", "exact", nprocs=2, env=SHM)["exact"]


@pytest.mark.full
@pytest.mark.parametrize(
    "case",
    ["stage1", "stage2", "stage3", "stage2_small_buckets", "stage2_reduce_every_microbatch", "stage3_unused_parameter"],
)
def test_training_through_mailboxes_matches_plain_pytorch(exact, case):
    """4 optimizer steps, accumulation 2, clipping, two param groups, StepLR (as test_core)."""
    result = exact[case]
    assert result["steps"] == 4 and result["param_change"] > 1e-3
    assert result["grad_diff"] <= 1e-5
    assert result["param_diff"] <= 1e-5
