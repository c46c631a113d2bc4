"""The engine contract (``engine/api.py``) without Lightning: a plain ``torch.distributed`` loop on 2 gloo
processes drives each engine (stages 1 and 2: ``ZeroDataParallel``; stage 3: ``FullyShardedEngine``) for 3 steps
with accumulation, clipping, 2 param groups and an LR schedule, and ends where single-process PyTorch does."""

import pytest

from tests.launch import launch

pytestmark = pytest.mark.slow
STAGES = ["stage1", "stage2", "stage3"]


@pytest.fixture(scope="module")
def report():
    return launch("tests.distributed.worker_engine", *STAGES, nprocs=2)


@pytest.mark.parametrize("stage", STAGES)
def test_a_plain_loop_through_the_contract_equals_single_process_pytorch(report, stage):
    result = report[stage]
    assert result["change"] > 1e-3, "the reference must move the parameters"
    assert result["diff"] <= 1e-5, result


@pytest.mark.parametrize("stage", STAGES)
def test_every_engine_implements_the_contract_with_one_record_per_trainable_parameter(report, stage):
    result = report[stage]
    assert result["protocols"], "engine and optimizer handle satisfy ShardingEngine / OptimizerShards"
    assert result["names"], "the engine's records name every trainable parameter, in module order"
    assert result["optimizer_names"], "the optimizer's records name its parameters in param_groups order"
    assert result["rows_are_chunks"], "each record's rows are at most one dim-0 chunk"
