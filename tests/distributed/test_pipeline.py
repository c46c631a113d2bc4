"""PipelineRunner on 2 CPU ranks (gloo), without Lightning: one pipeline of 2 stages (and 2x2 interleaved
virtual stages) trains exactly as the unsplit model does in one process. The Trainer integration is tested in
test_pipeline_trainer.py."""

import pytest

from lightning_zero.pipeline import layer_parameters, split_bounds
from tests.distributed.worker_pipeline import build
from tests.launch import launch

pytestmark = pytest.mark.slow
SCHEDULES = ["gpipe", "1f1b", "interleaved"]


@pytest.fixture(scope="module")
def report():
    return launch("tests.distributed.worker_pipeline", *SCHEDULES, nprocs=2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_three_steps_equal_the_unsplit_reference(report, schedule):
    result = report[schedule]
    assert result["param_diff"] <= 1e-5, result
    assert result["losses"] == pytest.approx(result["reference_losses"], abs=1e-5)
    assert result["eval_loss"] == pytest.approx(result["reference_eval_loss"], abs=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stages_keep_the_unsplit_parameter_names_and_hold_each_once(report, schedule):
    assert report[schedule]["names_cover_model"] and report[schedule]["names_disjoint"]


def test_the_cuts(report):
    assert report["gpipe"]["bounds"] == [0, 5, 9]  # 9 layers: 5 + 4
    assert report["interleaved"]["bounds"] == [0, 3, 5, 7, 9]  # 4 virtual stages
    # by parameter count: the input layer (8x16) is lighter than a block, so the best cut takes 4 layers first
    assert report["1f1b"]["bounds"] == split_bounds(build(), 2, "params") == [0, 4, 9]
    weights = layer_parameters(build())
    assert max(sum(weights[:4]), sum(weights[4:])) < max(sum(weights[:5]), sum(weights[5:]))
