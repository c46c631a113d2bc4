"""Full checkpoints across stages, a single process, bad input and a failing rank."""

import pytest

from tests.launch import LaunchError, launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def edges():
    return launch("tests.distributed.worker_edges", "checkpoint", "sharded", "bad_input", nprocs=2)


@pytest.mark.parametrize("case", ["stage2_to_stage3", "stage3_to_stage1"])
def test_full_checkpoint_is_plain_and_resumes_at_another_stage(edges, case):
    result = edges["checkpoint"][case]
    assert result["keys_match"]  # the module's own parameter names
    assert result["param_diff"] <= 1e-5
    assert result["optim_groups_match"]
    assert result["optim_state_diff"] <= 1e-6  # torch.optim format, full tensors, equal to plain AdamW's
    assert result["restored_param_diff"] == 0.0
    assert result["restored_optim_diff"] == 0.0
    assert result["restored_lr"] == result["saved_lr"]
    assert result["resumed_steps"] == 6


@pytest.mark.parametrize("case", ["stage2_to_stage3", "stage3_to_stage1"])
def test_sharded_checkpoint_directory_resumes_at_another_stage(edges, case):
    result = edges["sharded"][case]
    assert result["is_dir"]
    assert result["leftovers"] == []  # no temporary or old directories left beside it
    assert result["restored_param_diff"] == 0.0
    assert result["restored_optim_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert result["restored_optim_diff"] == 0.0
    assert result["optim_entries"] == 14
    assert result["restored_lr"] == result["saved_lr"]
    assert result["resumed_steps"] == 6


def test_non_elementwise_optimizer_is_refused_on_every_rank(edges):
    result = edges["bad_input"]["lbfgs"]
    assert result["type"] == "TypeError"
    assert "LBFGS" in result["message"] and "AdamW" in result["message"]
    assert "first failure" not in result["message"]  # same error on both ranks: nothing to add


def test_model_without_trainable_parameters_is_refused(edges):
    result = edges["bad_input"]["frozen"]
    assert result["type"] == "ValueError"
    assert "no trainable parameters" in result["message"]


def test_a_failing_rank_brings_the_run_down_with_its_error():
    with pytest.raises(LaunchError) as err:
        launch("tests.distributed.worker_edges", "rank_failure", nprocs=2, timeout=120)
    message = str(err.value)
    assert "timed out" not in message
    rank0 = message.split("----- rank 1 -----")[0]
    assert "boom from rank 1 at batch 2" in rank0  # the survivor names the cause, not just "connection closed"


def test_every_stage_runs_in_a_single_process():
    result = launch("tests.distributed.worker_core", "single", nprocs=1)["single"]
    for stage in (1, 2, 3):
        assert result[f"stage{stage}"]["param_diff"] <= 1e-5
        assert result[f"stage{stage}"]["grad_diff"] <= 1e-5
