"""``ZeroStrategy(optimizer_state_dtype="bf16")`` through lightning.Trainer on 2 CPU ranks (gloo): every stage, on the
device and offloaded, against a plain-PyTorch emulation of the same arithmetic; its bytes; its checkpoints."""

import pytest

from tests.distributed.worker_state_dtype import CONFIGS
from tests.launch import launch

WORLD = 2
pytestmark = pytest.mark.slow
CASES = [f"{name}_32-true" for name, _, _ in CONFIGS] + ["stage2_offload_bf16-mixed"]


@pytest.fixture(scope="module")
def report():
    return launch("tests.distributed.worker_state_dtype", "exact", "checkpoint", nprocs=WORLD)


@pytest.mark.parametrize("case", CASES)
def test_bf16_states_equal_a_plain_pytorch_emulation(report, case, record_property):
    """4 steps of 2 accumulated micro-batches, clipping by norm, 2 param groups, a StepLR schedule. The emulation is
    torch's AdamW whose moments are rounded to bf16 after every step: the same arithmetic in the same order, so the
    bound is 1e-6 (it ends bit for bit equal); the fp32-state run is 5e-5 away, which no rounding of our own hides."""
    result = report["exact"][case]
    record_property("max |dparam| vs emulation", result["param_diff_emulation"])
    assert result["steps"] == 4
    assert result["state_dtypes"] == ["bfloat16"] and result["fp32_state_dtypes"] == ["float32"]
    assert result["param_diff_emulation"] <= 1e-6
    assert result["state_diff_emulation"] <= 1e-6
    assert result["param_diff_fp32_states"] > 1e-6, "bf16 states left the run where fp32 states take it"


@pytest.mark.parametrize("case", CASES)
def test_bf16_states_hold_half_the_bytes_where_the_state_lives(report, case):
    """Adam's two moments at 2 bytes an element instead of 4, on the device or on the host (step counts aside)."""
    result = report["exact"][case]
    assert result["state_bytes"] * 2 == result["fp32_state_bytes"] > 0
    assert result["host_state_bytes"] * 2 == result["fp32_host_state_bytes"]
    assert (result["host_state_bytes"] > 0) == ("offload" in case or "params" in case)


@pytest.mark.parametrize("case", ["sharded_stage2", "full_stage3", "sharded_stage2_to_3"])
def test_bf16_states_resume_exactly(report, case):
    """One epoch, a checkpoint, a new Trainer for the second epoch, against the uninterrupted run (the last one
    resumes a stage-2 checkpoint at stage 3)."""
    result = report["checkpoint"][case]
    assert result["steps"] == 6
    assert result["param_diff"] == 0.0
    assert result["optim_diff"] == 0.0


@pytest.mark.parametrize(
    ("case", "dtype"),
    [("bf16_into_fp32_sharded", "float32"), ("bf16_into_fp32_full", "float32"), ("fp32_into_bf16_full", "bfloat16")],
)
def test_a_checkpoint_loads_into_a_run_of_the_other_state_dtype(report, case, dtype):
    """The loaded state is held in the resuming run's dtype before its first step."""
    result = report["checkpoint"][case]
    assert result["steps"] == 6
    assert result["loaded_dtypes"] == [dtype]
