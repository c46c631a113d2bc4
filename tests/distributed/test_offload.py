"""CPU offload through lightning.Trainer on 2 CPU ranks (gloo). Host and device are the same memory here,
so the offload path runs with synchronous copies; everything else is the code an accelerator runs."""

import pytest

from tests.launch import launch
from tests.tolerances import assert_reordered_fp32, assert_reordered_fp32_moments

WORLD = 2
pytestmark = pytest.mark.slow

CONFIGS = ["stage1_optimizer", "stage2_optimizer", "stage3_optimizer", "stage3_params"]


@pytest.fixture(scope="module")
def report_full():
    """The full marker's cases: stage 3's refusals and partial offload in parts at stage 3."""
    out = launch("tests.distributed.worker_offload", "refusals_stage3", "stage3_parts_partial", nprocs=WORLD)
    return {"during_backward": out["refusals_stage3"], "stage3_parts": out["stage3_parts_partial"]}


def _report(request, stage_or_case) -> dict:
    full = stage_or_case in (3, "partial")
    return request.getfixturevalue("report_full" if full else "report")


@pytest.fixture(scope="module")
def report():
    return launch(
        "tests.distributed.worker_offload",
        "exact",
        "during_backward",
        "clipped_during_backward",
        "memory",
        "checkpoint",
        "partial",
        "stage3_parts",
        "delayed",
        "delayed_checkpoint",
        nprocs=WORLD,
    )


@pytest.fixture(scope="module")
def alone():
    """One rank: the cases of ``during_backward`` that FSDP2 runs without a reduce-scatter at stage 3."""
    return launch("tests.distributed.worker_offload", "during_backward_alone", nprocs=1)["during_backward_alone"]


@pytest.fixture(scope="module")
def convergence():
    return launch("tests.distributed.worker_offload", "delayed_convergence", nprocs=WORLD)


def _as_without_offload(case: str, result: dict) -> None:
    """The host steps with torch's fused CPU kernel where the run without offload steps with the optimizer's default
    (``lightning_zero/engine/offload/``): another order of the same step's roundings (``tests/tolerances.py``)."""
    assert_reordered_fp32(case, result["param_diff_no_offload"], result["lr"], result["steps"])


@pytest.mark.parametrize("config", CONFIGS)
def test_offload_equals_the_same_run_without_offload(report, config, record_property):
    """4 steps of 2 accumulated micro-batches, clipping by norm, 2 param groups, a StepLR schedule."""
    result = report["exact"][f"{config}_32-true"]
    record_property("max |dparam| vs plain PyTorch", result["param_diff_reference"])
    assert result["steps"] == 4
    _as_without_offload(config, result)
    assert result["param_diff_reference"] <= 1e-5
    assert result["grad_diff_reference"] <= 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3, "3_params"])
@pytest.mark.parametrize(("clip", "fired"), [("never", 0), ("always", 6), ("some", 2)])
def test_clipped_parts_start_during_backward_and_end_bit_for_bit_as_the_serial_clipped_step(report, stage, clip, fired):
    """[Note: speculative clipping]: with `gradient_clip_val` the host steps parts during backward before the norm is
    known, and puts them back where the clip fires; 6 steps against the same run with `overlap_comm=False` (today's
    clipped step, nothing started early), the clip firing on none of them, on all and on 2."""
    result = report["clipped_during_backward"][f"stage{stage}_{clip}"]
    overlap, serial = result["overlap"], result["serial"]
    assert overlap["steps"] == serial["steps"] == 6
    assert overlap["parts_started"] >= 2 * 6 and serial["parts_started"] == 0
    assert overlap["speculated_steps"] == 6 and overlap["clips_fired"] == fired
    assert result["param_diff_serial"] == 0.0
    # The copies held until the clip: every master and its state, the planner's (4 + 8) bytes an element, plus the
    # step counts (4 bytes a parameter, which the planner leaves out).
    counts = 4 * len(overlap["param_names"])
    assert overlap["copied_bytes"] == overlap["master_bytes"] + overlap["optimizer_host_bytes"] + counts


def test_stage3_with_offloaded_parameters_steps_a_part_per_unit_during_backward_bit_for_bit(report):
    """``offload_params``: each unit's host shards are stepped in place as FSDP2 finishes its gradients, without
    clipping (as with it above), bit for bit the step after backward."""
    result = report["clipped_during_backward"]["stage3_params_unclipped"]
    assert result["overlap"]["parts_started"] == 3 * 6 and result["serial"]["parts_started"] == 0
    assert result["param_diff_serial"] == 0.0


def test_clipped_parts_with_bf16_state_are_put_back_bit_for_bit(report):
    """The undo of a part whose state is held in bf16 (``optimizer_state_dtype="bf16"``), the clip firing on 2 of 6."""
    result = report["clipped_during_backward"]["stage2_some_bf16_states"]
    assert result["overlap"]["clips_fired"] == 2 and result["overlap"]["parts_started"] >= 12
    assert result["param_diff_serial"] == 0.0


def test_gradients_changed_by_hand_after_speculated_parts_put_them_back_bit_for_bit(report):
    """An ``optimizer_step`` override clamps the gradients inside the closure after parts were stepped speculatively:
    they are put back (Lightning's norm clip after it then finds nothing speculated) and stepped with the clamped
    gradients, as the serial step does."""
    result = report["clipped_during_backward"]["stage2_clamped_by_hand"]
    assert result["overlap"]["parts_started"] >= 12 and result["serial"]["parts_started"] == 0
    assert result["overlap"]["speculated_steps"] == 0
    assert result["param_diff_serial"] == 0.0


def test_clipping_by_value_keeps_the_step_for_after_backward(report):
    """Each element clipped on its own could run in the part; today it runs after backward, and nothing starts early."""
    result = report["clipped_during_backward"]["stage2_value"]
    assert result["overlap"]["parts_started"] == result["serial"]["parts_started"] == 0
    assert result["overlap"]["speculated_steps"] == 0
    assert result["param_diff_serial"] == 0.0


@pytest.mark.parametrize("config", CONFIGS[:2])
def test_gradients_reach_the_host_as_buckets_land_and_the_host_steps_in_parts(report, config):
    """The overlapped schedule of [Note: the offloaded step]: every step's gradients were copied to the host when
    their bucket's reduction landed (none waited for the finalize), and the host stepped bucket runs one by one."""
    result = report["exact"][f"{config}_32-true"]
    assert len(result["staged_on_landing"]) == 4
    assert all(staged == total > 0 for staged, total in result["staged_on_landing"])
    assert result["host_step_parts"] > 1


@pytest.mark.parametrize(
    "case",
    [
        "stage1",
        "stage2",
        "stage2_unused",
        "stage2_every_microbatch",
        "stage3",
        "stage3_unused",
        "stage3_reduced_in_place",
    ],
)
def test_without_clipping_the_host_steps_parts_during_backward_bit_for_bit(report, case):
    """No clipping, no loss scaler ([Note: the host step during backward]), 4 steps of 2 accumulated micro-batches,
    2 param groups, StepLR: each part of the host step started in the worker thread as its buckets landed (stage 3:
    as FSDP2 finished its unit, whether the unit's reduction landed after backward or, with a gradient hook on every
    parameter, in place as on an accelerator), the first while others were still reducing, and the parameters are
    bit for bit those of the same run with ``overlap_comm=False`` (the whole step left to ``optimizer.step()``), and
    plain PyTorch's."""
    result = report["during_backward"][case]
    assert result["steps"] == 4
    assert result["param_diff_serial"] == 0.0
    assert result["param_diff_reference"] <= 1e-5
    assert result["module_diff"] == 0.0
    assert result["serial_early"] == [[0, 0]] * 4
    overlapped, serial = result["monitor_grad_norms"]  # ZeroMonitor(grad_norm_type=2) read them on the way, both runs
    assert overlapped == serial and overlapped > 0
    if case.endswith("unused"):
        # A head no rank uses: whether some rank did is known only when backward ends (stage 3 reduces a zero
        # gradient for it meanwhile), so its part waits for the step.
        assert all(0 < started < result["parts"] for started, _ in result["early"])
        assert "MainThread" in result["threads"]
    else:
        assert all(started == result["parts"] > 1 and in_flight > 0 for started, in_flight in result["early"])
        assert result["threads"] == ["lightning_zero-host-step_0"]


@pytest.mark.parametrize("stage", [2, 3])
def test_on_one_rank_the_host_steps_parts_during_backward_bit_for_bit(alone, stage):
    """One rank (one GPU's case), the same run as above: FSDP2 copies where it would reduce and never calls the
    reduce-scatter, and still each unit's part starts in the worker as its gradients are made ([Note: units finished
    alone]); bit for bit ``overlap_comm=False``, and plain PyTorch's parameters."""
    result = alone[f"stage{stage}"]
    assert result["steps"] == 4 and result["serial_early"] == [[0, 0]] * 4
    assert all(started == result["parts"] > 1 and in_flight > 0 for started, in_flight in result["early"])
    assert result["threads"] == ["lightning_zero-host-step_0"]
    assert result["param_diff_serial"] == 0.0 and result["module_diff"] == 0.0
    assert result["param_diff_reference"] <= 1e-5


@pytest.mark.parametrize("case", ["full", pytest.param("partial", marks=pytest.mark.full)])
def test_stage3_steps_the_host_in_parts_bit_for_bit(request, case):
    """Stage 3 with the optimizer offloaded (``offload_optimizer=True`` and ``0.5``), clipping, 2 accumulated
    micro-batches, 2 param groups, StepLR: the host steps the parameters a run at a time (each part's gradient copies
    waited for alone, its masters sent back while the next part steps), bit for bit the same run whose optimizer has a
    step hook and so steps everything in one call, and within 1e-5 of plain PyTorch."""
    result = _report(request, case)["stage3_parts"][case]
    assert result["calls_per_step"] > 1 and result["calls_per_step_one_call"] == 1
    assert result["param_diff_one_call"] == 0.0
    assert result["param_diff_reference"] <= 1e-5


def test_stage3_parts_step_on_the_kernel_of_one_call(report):
    """Adagrad, whose fused CPU kernel does not take DTensors: each part steps host masters alone, on the fused
    kernel as the one call and the host steps started during backward do, bit for bit."""
    result = report["stage3_parts"]["full_adagrad"]
    assert result["calls_per_step"] > 1 and result["calls_per_step_one_call"] == 1
    assert result["param_diff_one_call"] == 0.0


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.full)])
def test_clipping_by_hand_after_parts_were_stepped_is_refused_with_the_fix(request, stage):
    """``self.clip_gradients`` inside the step's closure (an ``optimizer_step`` override), where Lightning's clipping
    settings cannot see it and no hook shows it."""
    message = _report(request, stage)["during_backward"][f"clip_in_closure_stage{stage}"]
    assert "during backward" in message and "overlap_comm=False" in message and "gradient_clip_val" in message


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.full)])
def test_a_hook_between_backward_and_the_step_keeps_the_whole_step_for_it(request, stage):
    """``self.clip_gradients`` in ``on_before_optimizer_step`` (a module's or a callback's hook there may change the
    gradients): no part starts during backward, and the run is bit for bit Lightning's ``gradient_clip_val``."""
    result = _report(request, stage)["during_backward"][f"clip_in_hook_stage{stage}"]
    assert result["early"] == [[0, 0]] * 4
    assert result["diff"] == 0.0


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.full)])
def test_a_backward_whose_step_never_came_is_refused_at_the_next_one(request, stage):
    """An ``optimizer_step`` override that runs the closure and skips ``optimizer.step()``: the host already stepped
    that backward's parts, so the next backward stops with the fix instead of landing two updates at once."""
    message = _report(request, stage)["during_backward"][f"step_skipped_stage{stage}"]
    assert "no `optimizer.step()` followed it" in message and "overlap_comm=False" in message


@pytest.mark.parametrize("config", CONFIGS[1:])
def test_offload_equals_the_same_run_without_offload_in_bf16_mixed(report, config):
    result = report["exact"][f"{config}_bf16-mixed"]
    _as_without_offload(config, result)  # the fp32 masters: the compute copies are rounded from them alike


#: Stage 1 shares the stage 2 offload path; its bf16 case is not run.
RUNS = [*((c, "32-true") for c in CONFIGS), *((c, "bf16-mixed") for c in CONFIGS[1:])]


@pytest.mark.parametrize(("config", "precision"), RUNS)
def test_optimizer_state_lives_on_the_host_at_shard_size(report, config, precision):
    where = report["exact"][f"{config}_{precision}"]["placement"]
    assert where["state_devices"] == ["cpu"] and where["key_devices"] == ["cpu"]
    assert where["state_numel_is_shard"]
    assert where["max_shard_numel"] < where["max_full_numel"], "the model must have something to shard"
    assert not where["state_shares_module_storage"]
    if config == "stage3_params":
        # The optimizer steps FSDP2's host-resident sharded parameters themselves.
        assert where["state_is_dtensor"] and where["keys_share_module_storage"]
    else:
        # The optimizer steps host master copies, separate from the parameters the model computes with.
        assert where["keys_are_masters"] and not where["keys_share_module_storage"]


@pytest.mark.parametrize("config", CONFIGS)
def test_no_full_size_optimizer_state_is_ever_allocated(report, config):
    """Every tensor any optimizer step produced (state creation included) is at most one shard in size."""
    result = report["exact"][f"{config}_32-true"]
    assert 0 < result["largest_step_tensor"] <= result["placement"]["max_shard_numel"]


@pytest.mark.parametrize("config", CONFIGS[1:])
def test_overflow_skips_the_offloaded_step(report, config):
    result = report["exact"][f"{config}_overflow"]
    assert result["scales"] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert result["skipped"] == 1
    assert result["params_unchanged_at_k"] and result["optim_unchanged_at_k"]
    assert result["params_changed_after_k"] > 0 and result["finite"]


@pytest.mark.parametrize(("name", "stage", "params"), [("zero2_offload", 2, False), ("zero3_offload", 3, True)])
def test_registered_offload_names_train_exactly(report, name, stage, params):
    result = report["exact"][name]
    assert (result["stage"], result["offload_optimizer"], result["offload_params"]) == (stage, True, params)
    _as_without_offload(name, result)


#: (device, host) bytes per parameter for fp32 AdamW on N ranks (ZeRO-Offload: 16P/N on the host).
FP32_FORMULAS = {
    "none_stage2": lambda n: (4 + 12 / n, 0),
    "stage1_optimizer": lambda n: (8, 16 / n),
    "stage2_optimizer": lambda n: (4 + 4 / n, 16 / n),
    "stage3_optimizer": lambda n: (8 / n, 16 / n),
    "stage3_params": lambda n: (0, 16 / n),
}
#: bf16-mixed: 2-byte parameters and gradient shards on the device, fp32 masters, gradients and Adam on the host.
MIXED_FORMULAS = {
    "stage2_optimizer": lambda n: (2 + 2 / n, 16 / n),
    "stage3_params": lambda n: (0, 16 / n),
}


@pytest.mark.parametrize(
    ("key", "formula"),
    [
        *((f"{k}_32-true", f) for k, f in FP32_FORMULAS.items()),
        *((f"{k}_bf16-mixed", f) for k, f in MIXED_FORMULAS.items()),
    ],
)
def test_device_and_host_bytes_match_the_offload_formulas(report, key, formula, record_property):
    measured = report["memory"][key]
    params = measured["params_count"]
    device, host = (per_param * params for per_param in formula(WORLD))
    record_property("device + host bytes / formula", (measured["device"] + measured["host"]) / (device + host))
    assert measured["device"] == pytest.approx(device, rel=0.02, abs=1024)
    assert measured["host"] == pytest.approx(host, rel=0.02)
    # Nothing is left out of the split: the garbage collector's count of every live tensor agrees.
    assert measured["live"] == pytest.approx(measured["device"] + measured["host"], rel=0.02)


@pytest.mark.parametrize(
    "case",
    [
        "stage2_offload->offload",
        "stage2_offload->plain",
        "stage3_plain->params",
        "stage3_optimizer->optimizer_full",
        "stage3_params->params",
    ],
)
def test_offloaded_checkpoints_resume_exactly_with_or_without_offload(report, case):
    result = report["checkpoint"][case]
    assert result["steps"] == 6
    # against the uninterrupted run without offload: the host's step is another kernel (see above)
    assert_reordered_fp32(case, result["param_diff"], result["lr"], result["steps"])
    assert_reordered_fp32_moments(case, result["optim_diff"], result["steps"], result["moment_scale"])


@pytest.mark.parametrize("case", ["stage2_0.25", "stage2_0.5", "stage3_0.25", "stage3_0.5"])
def test_partial_offload_is_exact_and_puts_that_share_on_the_host(report, case):
    """``offload_optimizer=0.25 / 0.5``: the parameters of the run without offload, and Adam's state on the host for
    the parameters the share picked, which is the ratio up to one parameter (whole parameters move)."""
    result = report["partial"][case]
    ratio = float(case.split("_")[1])
    _as_without_offload(case, result)
    assert result["param_diff_reference"] <= 1e-5
    assert result["host_share_of_state"] == pytest.approx(result["planned_share"], abs=1e-3)
    assert ratio - result["largest_share"] <= result["host_share_of_state"] <= ratio


def test_partial_offload_in_bf16_mixed_equals_no_offload(report):
    result = report["partial"]["stage2_0.5_bf16"]
    _as_without_offload("stage2_0.5_bf16", result)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_delayed_update_is_zero_offloads_dpu_step_for_step(report, stage):
    """``offload_step_delay=1``, 4 steps of 2 accumulated micro-batches, clipping, 2 param groups, StepLR: the
    parameters of plain PyTorch running the delayed update (each step computes with the parameters of two steps
    back), not those of the exact step; the host steps ran in the worker thread, each after the first a part at a
    time ([Note: the delayed update in parts]: one call for the first, whose rows nothing sent yet), and the module
    ends with every update landed."""
    result = report["delayed"][f"stage{stage}"]
    assert result["steps"] == 4
    assert result["parts"] >= 2 and result["host_step_calls"] == 1 + 3 * result["parts"]
    assert result["param_diff_reference"] <= 1e-5
    assert result["param_diff_exact"] > 1e-3, "the update must be delayed"
    assert result["threads"] == ["lightning_zero-host-step_0"]
    assert result["module_diff_final"] == 0.0


def test_the_monitor_counts_the_state_a_running_host_step_creates(report):
    """``ZeroMonitor(log_every_n_steps=1)`` under the delayed update, step 1's host step held in the worker until step
    2's ``on_after_backward``: the monitor's figure at step 2 waits for it and counts the optimizer state it created,
    as at steps 3 and 4 (step 1's has none yet)."""
    result = report["delayed"]["monitor"]
    assert result["opened_in_time"] is True
    first, *later = result["states"]
    assert len(later) == 3 and len(set(later)) == 1 and later[0] > first


def test_an_exponential_average_under_the_delayed_update_averages_every_update_taken(report):
    """``EMAWeightAveraging(decay=0.5)`` at stage 2 with ``offload_step_delay=1``: the module ends with the average
    of the masters after each of the 4 updates, as plain PyTorch computes it, not with the last update alone."""
    result = report["delayed"]["ema"]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    # plain PyTorch's foreach AdamW against the host's fused kernel; an average of weights each within the bound
    assert_reordered_fp32("ema", result["vs_reference"], result["lr"], result["steps"])
    assert result["vs_last_update"] > 1e-3


def test_an_overflow_skips_the_delayed_step_and_leaves_the_masters_as_they_were(report):
    """16-mixed, an inf at step 2: that step starts no host step (the masters and the optimizer state stay those of
    step 1; the update pending from step 1 still lands), the loss scale halves, and training goes on."""
    result = report["delayed"]["stage2_overflow"]
    assert result["scales"] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert result["skipped"] == 1
    assert result["params_unchanged_at_k"] and result["optim_unchanged_at_k"]
    assert result["params_changed_after_k"] > 0 and result["finite"]


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_delayed_run_resumes_exactly_from_its_checkpoints(report, fmt):
    """Saved after epoch 1 with an update pending, resumed for epoch 2: the uninterrupted delayed run's parameters
    and optimizer state, bit for bit (the checkpoint keeps the parameters forward computes with beside the masters)."""
    result = report["delayed_checkpoint"][fmt]
    assert result["steps"] == 6
    assert result["param_diff"] == 0.0 and result["optim_diff"] == 0.0


def test_a_delayed_checkpoint_keeps_the_lagging_parameters_and_resumes_without_the_delay(report):
    """The file holds every update in its state_dict and, beside it, the parameters forward was computing with. A
    resume with the delay computes with the second; one without it with the first (the pending update landed)."""
    result = report["delayed_checkpoint"]
    assert result["full"]["lagging_names"] and result["full"]["lagging_behind_by"] > 0
    assert result["resumed_delayed"]["vs_lagging"] == 0.0 and result["resumed_delayed"]["vs_state_dict"] > 0
    assert result["resumed_exact"]["vs_state_dict"] == 0.0 and result["resumed_exact"]["vs_lagging"] > 0


@pytest.mark.full
def test_the_delayed_update_follows_the_exact_loss_curve_of_the_demo_gpt(convergence):
    """100 steps of the demo GPT on the demo's character data: after the 20 steps of warm-up, every 10-step mean of the
    training loss within 2% of the exact offloaded run's (a calibration of the staleness: ``full``)."""
    runs = convergence["delayed_convergence"]
    exact, delayed = runs["exact"]["losses"], runs["delayed"]["losses"]
    assert runs["exact"]["steps"] == runs["delayed"]["steps"] == len(exact) == len(delayed) == 100
    assert exact[-1] < exact[0] - 0.5, "the run must learn for the comparison to mean something"
    for start in range(20, 100, 10):
        mean_exact, mean_delayed = sum(exact[start : start + 10]) / 10, sum(delayed[start : start + 10]) / 10
        assert abs(mean_delayed - mean_exact) <= 0.02 * mean_exact, (start, mean_exact, mean_delayed)
