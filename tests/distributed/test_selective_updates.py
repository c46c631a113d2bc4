"""Selective updates (``ZeroStrategy(offload_update_interval=k, offload_topk_ratio=r)``) through lightning.Trainer on
2 CPU ranks (gloo): against a plain-PyTorch emulation of the same arithmetic, and checkpoints that resume exactly."""

import pytest

from tests.distributed.worker_selective import CASES_EXACT
from tests.launch import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = {"LZ_SHARED_DIR": str(tmp_path_factory.mktemp("selective"))}
    cases = ("exact", "edges", "checkpoint", "save_mid_interval", "from_exact_steps", "growth")
    two = launch("tests.distributed.worker_selective", *cases, nprocs=2, env=env)
    one = launch("tests.distributed.worker_selective", "resume_in_other_world", nprocs=1, env=env)
    return {**two, **one}


@pytest.mark.parametrize("case", [name for name, *_ in CASES_EXACT])
def test_selective_updates_equal_a_plain_pytorch_emulation(report, case, record_property):
    """10 steps of 2 accumulated micro-batches with clipping by norm, 2 param groups and a StepLR schedule: columns
    chosen at the first step and again at the end of intervals (after steps 3 and 7 for k=2, 7 for k=4, every
    interval), columns joining and leaving the device there, host steps landing at their fixed steps, the last at the
    end of fit; one case with experts some steps leave without a gradient and one never picked. The emulation runs on
    whole tensors in one process from plain PyTorch's gradients, so the bound is plain training's own (1e-5); plain
    AdamW is far away, as selective updates are inexact by design."""
    result = report["exact"][case]
    record_property("max |dparam| vs emulation", result["param_diff_emulation"])
    assert result["steps"] == 10
    assert result["param_diff_emulation"] <= 1e-5
    assert result["param_diff_exact"] > 100 * 1e-5, "selective updates ended where the exact step does"
    assert result["emulation_vs_exact"] > 1e-3
    assert result["columns_moved"] > 0, "no choice after the first moved a column: the test misses the moves"


@pytest.mark.parametrize("case", ["sharded_stage2", "full_stage1", "sharded_stage2_to_1"])
def test_selective_updates_resume_exactly_mid_interval(report, case):
    """Saved after step 3 of 6: mid-interval, the interval's gradient sum filled, a host step in flight and columns
    that left the device waiting for it; a new
    Trainer resumes for the rest and ends bit for bit where the uninterrupted run ends (the last at another stage)."""
    result = report["checkpoint"][case]
    assert result["steps"] == 6
    assert result["param_diff"] == 0.0
    assert result["optim_diff"] == 0.0


@pytest.mark.parametrize("name", ["selective_sharded", "selective_full.ckpt"])
def test_selective_updates_resume_on_another_world_size(report, name):
    """Saved on 2 ranks mid-interval with a host step in flight and columns that left the device waiting for it,
    resumed on 1: before its first step the run holds
    the parameters forward computed with, the column counts, choices and gradient sums, and the optimizer's state
    as they were saved; then it trains on."""
    result = report["resume_in_other_world"]
    assert result["world"] == 1 and result["pending_at_save"] and result["leaving_at_save"] > 0
    restored = result[name]
    assert restored["selective_keys"]
    assert restored["seen_diff"] == 0.0
    assert restored["selective_diff"] == 0.0
    assert restored["optim_diff"] == 0.0
    assert restored["steps"] == 6 and restored["finite"]


def test_an_optimizer_selective_updates_cannot_run_is_refused_by_name(report):
    """Selective updates run Adam's arithmetic per column: SGD is refused on every rank before the first step."""
    message = report["edges"]["sgd"]
    assert "supports torch.optim.Adam and AdamW, not SGD" in message
    assert "offload_update_interval=1" in message


def test_bf16_mixed_ends_with_the_masters_in_fp32(report):
    """Under bf16-mixed the device's columns go back to the host masters before fit restores fp32 weights, so the
    weights left equal the masters a checkpoint holds."""
    mixed = report["edges"]["mixed"]
    assert mixed["steps"] == 7 and mixed["dtypes"] == ["torch.float32"]
    assert mixed["seen_vs_masters"] == 0.0 and mixed["change"] > 1e-3


def test_a_checkpoint_of_exact_steps_resumes_with_selective_updates_counting_on(report):
    """4 exact steps, then 2 selective ones (one interval, its host step landed at the end of fit): columns on the
    host took 1 more step, columns on the device 2, each on top of the 4 the optimizer's ``step`` counted."""
    result = report["from_exact_steps"]
    assert result["steps"] == 6 and result["finite"]
    assert (result["fewest_column_steps"], result["most_column_steps"]) == (5.0, 6.0)


def test_a_checkpoint_resumed_with_other_selective_settings_is_refused_by_name(report):
    """Saved mid-interval with k=2, resumed with k=4: the interval's sums and the pending host step follow the saved
    schedule, so the resume stops with both settings named."""
    message = report["resume_in_other_world"]["other_settings"]
    assert "offload_update_interval=2" in message and "offload_update_interval=4" in message
    assert "Resume with the saved settings" in message


def test_a_head_unfrozen_during_fit_joins_selective_updates_as_the_emulation_has_it(report):
    """A head frozen at the start and unfrozen into a param group of its own at step 4 of 8: the layout grows with
    the device's columns written back and the schedule carried over, the head's bias goes to the device and its
    weight's columns to the host until the next choice; equal to the emulation doing the same in plain PyTorch."""
    result = report["growth"]
    assert result["steps"] == 8 and result["growths"] == 1
    assert result["param_diff_emulation"] <= 1e-5
    assert result["head_change"] > 1e-3
