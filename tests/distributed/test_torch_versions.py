"""A checkpoint resumed by a torch release other than the one that wrote it (``worker_torch_versions.py``). Here
both halves run under the installed torch; ``make test-torch`` runs the same halves under the oldest and the newest
admitted release (``tests/torch_matrix.py``), with the same check."""

from __future__ import annotations

import pytest

from tests.launch import launch
from tests.tolerances import assert_reordered_fp32, assert_reordered_fp32_moments


def check_resumed(case: str, result: dict) -> None:
    """A resume is exact: the same numbers as this torch's uninterrupted run, bit for bit when the writer is this
    torch, within reordered fp32 rounding when another release computed the first epoch."""
    assert "refused" not in result, result.get("refused")
    assert result["steps"] == 6
    if result["written_by"] == result["resumed_by"]:
        assert result["param_diff"] == 0.0 and result["optim_diff"] == 0.0
        assert result["param_diff_to_writer"] == 0.0
    else:
        assert_reordered_fp32(case, result["param_diff"], result["lr"], result["steps"])
        assert_reordered_fp32_moments(case, result["optim_diff"], result["steps"], result["moment_scale"])


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    env = {"LZ_SHARED_DIR": str(tmp_path_factory.mktemp("torch_versions"))}
    launch("tests.distributed.worker_torch_versions", "write", nprocs=2, env=env)
    return launch("tests.distributed.worker_torch_versions", "resume", nprocs=2, env=env)["resume"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_written_and_resumed_by_this_torch_resumes_exactly(resumed, stage, record_property):
    result = resumed[f"stage{stage}"]
    record_property("max |dparam| vs uninterrupted", result["param_diff"])
    check_resumed(f"stage{stage}", result)
