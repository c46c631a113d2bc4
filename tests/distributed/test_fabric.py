"""``lightning_zero.fabric.ZeroStrategy`` in Lightning Fabric loops (gloo, CPU, 2 ranks): exact against plain
single-process PyTorch at stages 1-3 with and without optimizer offload, bf16-mixed against the emulation of its
arithmetic, model state on the ZeRO formulas, checkpoints a ``Trainer`` resumes from and the other way round, and a
loop killed mid-step that resumes to the parameters of an uninterrupted one."""

import pytest

from tests.distributed.test_core import FORMULAS
from tests.launch import LaunchError, launch
from tests.tolerances import DESIGN_FP32, assert_reordered_fp32

pytestmark = pytest.mark.slow

WORLD = 2


@pytest.fixture(scope="module")
def report():
    return launch("tests.distributed.worker_fabric", "exactness", "memory", "checkpoints", "errors")


EXACT = [
    "stage1",
    "stage2",
    "stage3",
    "stage1_offload",
    "stage2_offload",
    "stage3_offload",
    "stage3_separate_setup",
    "stage2_without_no_backward_sync",
    "stage3_clip_value",
    "stage1_zero_grad_without_step",
    "stage2_zero_grad_without_step",
    "stage3_zero_grad_without_step",
]


@pytest.mark.parametrize("case", EXACT)
def test_fabric_loop_trains_as_single_process(report, case):
    """3 steps of 2 micro-batches accumulated under ``fabric.no_backward_sync`` (or without it: exact, only slower),
    ``fabric.clip_gradients`` by norm (by value in one case), SGD with two param groups and a warmup schedule; the
    module built under ``fabric.init_module(empty_init=True)`` (the meta device at stage 3), set up with its optimizer
    or before it; ``optimizer.zero_grad()`` after a backward without a step drops its gradients."""
    result = report["exactness"][case]
    assert result["change"] > 100 * result["diff"]  # it trained
    assert result["diff"] <= DESIGN_FP32, result


@pytest.mark.parametrize("case", ["bf16_stage1", "bf16_stage2", "bf16_stage3", "fp16_stage2", "fp16_stage3"])
def test_fabric_mixed_precision_does_the_arithmetic_of_its_emulation(report, case):
    """Fabric's ``precision="bf16-mixed"`` becomes ZeroPrecision; ``16-mixed`` scales the loss (dynamic, 2**16)."""
    result = report["exactness"][case]
    assert result["plugin"] == "ZeroPrecision"
    assert result["precision"] == ("bf16-mixed" if case.startswith("bf16") else "16-mixed")
    assert result["change"] > 100 * result["diff"]
    assert_reordered_fp32(case, result["diff"], result["lr"], result["steps"])


def test_fp16_overflow_skips_the_step_on_every_rank(report):
    result = report["exactness"]["overflow"]
    assert result["unchanged"] and result["trains_on"]
    assert result["scale_after"] == result["scale_before"] / 2
    assert result["norm"] == float("inf")


def test_bf16_true_holds_everything_in_bf16(report):
    result = report["exactness"]["bf16_true"]
    assert result["dtypes"] == ["torch.bfloat16"] and result["change"] > 0


def test_fabric_collectives(report):
    result = report["errors"]
    assert result["all_reduce_mean"] == 1.5 and result["all_reduce_sum"] == 3.0
    assert result["broadcast"] == "from rank 1"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fabric_model_state_bytes_match_zero_formulas(report, stage):
    result = report["memory"][f"stage{stage}"]
    assert result["bytes"] == pytest.approx(FORMULAS[stage](result["params"], WORLD), rel=0.02)


def test_full_fabric_checkpoint_is_a_plain_file_under_the_loops_keys(report):
    entries = report["checkpoints"]["full_file_entries"]
    assert {"model", "optimizer", "scheduler", "step", "note"} <= set(entries)
    assert "state_dict" not in entries


@pytest.mark.parametrize("saved", ["fabric_to_trainer", "fabric_full_to_trainer"])
def test_trainer_resumes_from_a_fabric_checkpoint(report, saved):
    """A Fabric loop at stage 2 saves a sharded directory and a full file; a Trainer at stage 3 (stage 1 for the file)
    resumes from it and writes what it loaded as a full file: the module's and the optimizer's tensors are the ones
    Fabric saved."""
    result = report["checkpoints"][saved]
    assert result["names"] and result["tensors"] > 10
    assert result["max_diff"] == 0.0


def test_fabric_loads_a_trainer_checkpoint(report):
    result = report["checkpoints"]["trainer_to_fabric"]
    assert result["names"] and result["tensors"] > 10
    assert result["max_diff"] == 0.0
    assert {"epoch", "global_step", "loops"} <= set(report["checkpoints"]["trainer_remainder"])


def test_fabric_load_restores_the_loops_entries_and_load_raw_reads_a_state_dict(report):
    result = report["checkpoints"]
    assert result["restored_entries"]["step"] == 2 and result["restored_entries"]["note"] == "fabric"
    assert "state_dict" not in result["restored_entries"]["remainder"]
    assert result["scheduler_epoch"] == 2
    assert result["raw_loaded"]


def test_async_save_in_a_fabric_loop(report):
    """Two saves in the background, the first written while the next step trains; each loads into another stage bit
    for bit as it was when saved."""
    for step, result in enumerate(report["checkpoints"]["async_save"]):
        assert result["step"] == step + 1 and result["diff"] == 0.0


def test_init_weights_reads_a_fabric_full_file(report):
    assert report["checkpoints"]["init_weights_from_fabric_file"] == 0.0


def test_two_optimizers_load_by_their_keys(report):
    result = report["checkpoints"]["optimizers_by_key"]
    assert result["loaded"] == result["saved"] == [[0.2], [0.1]]
    assert "load all of them, or the first ones" in result["subset"]


def test_buffers_are_rank_zeros_after_a_step(report):
    result = report["checkpoints"]["buffers"]
    assert result["same_on_every_rank"] and result["moved"] > 0


def test_fp16_with_two_optimizers_unscales_each_by_its_backwards_scale(report):
    result = report["exactness"]["two_optimizers_fp16"]
    assert result["diff"] == 0.0
    # grown once a step, not once an optimizer, then halved once by the step both optimizers skipped
    assert result["scales"][0] == result["scales"][1] == 2.0**16 * 2**3 / 2


def test_killed_fabric_loop_resumes_to_the_uninterrupted_parameters(tmp_path):
    """Every rank SIGKILLed mid-step after the second step's checkpoint; a new launch loads the latest checkpoint and
    trains on from the step it records. The GPT has dropout: each rank's RNG state comes back with the checkpoint."""
    env = {"LZ_SHARED_DIR": str(tmp_path)}
    with pytest.raises(LaunchError):
        launch("tests.distributed.worker_fabric", "killed", env=env, fresh=True)
    resumed = launch("tests.distributed.worker_fabric", "resumed", env=env)["resumed"]
    uninterrupted = launch("tests.distributed.worker_fabric", "uninterrupted", env=env)["uninterrupted"]
    assert resumed["started_at"] == 2 and uninterrupted["started_at"] == 0
    assert resumed["params"] == uninterrupted["params"]


@pytest.fixture(scope="module")
def litgpt():
    pytest.importorskip("litgpt", reason="LitGPT is installed by `make install` (pip install --no-deps litgpt)")
    return launch("tests.distributed.worker_fabric", "litgpt")["litgpt"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_litgpt_pretrain_loop_trains_as_single_process(litgpt, stage):
    """A tiny ``litgpt.GPT`` set up as LitGPT's ``pretrain`` does (``init_module(empty_init=True)``, its
    ``initialize_weights``) and trained by its step (``chunked_cross_entropy``, accumulation, clipping)."""
    result = litgpt[f"pretrain_stage{stage}"]
    assert result["change"] > 100 * result["diff"]
    assert result["diff"] <= DESIGN_FP32, result


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_litgpt_lora_finetune_trains_the_adapters_alone(litgpt, stage):
    """LitGPT's LoRA fine-tuning: base weights by ``fabric.load_raw(strict=False)``, frozen; only the adapters train,
    exactly, and ``fabric.save(filter={"model": lora_filter})`` writes them alone."""
    result = litgpt[f"lora_stage{stage}"]
    assert result["base_loaded"] and result["frozen_unchanged"]
    assert result["change"] > 100 * result["diff"]
    assert result["diff"] <= DESIGN_FP32, result
    assert result["saved_lora_only"] and result["saved_lora_diff"] == 0.0


ERRORS = {
    "optimizer_before_module": "set up the module before its optimizer",
    "second_module": "shards one module per Fabric; GPTLightningModule is set up already",
    "foreign_parameters": "not one of GPTLightningModule's",
    "norm_type": "norm_type='inf'",
    "nonfinite_norm": "error_if_nonfinite=False",
    "save_without_module": "its modules: none",
    "save_reserved_key": "['state_dict'] are reserved",
    "save_optimizer_filter": "for the optimizer entries ['optimizer']",
    "load_directory_without_objects": "lightning-zero consolidate",
    "load_missing_entry_strict": "strict=False",
    "load_unsafe": "weights_only=False",
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_misuse_in_a_fabric_loop_fails_naming_the_fix(report, case):
    assert ERRORS[case] in report["errors"][case]


def test_an_optimizer_set_up_again_after_teardown_trains(report):
    assert report["errors"]["reused_optimizer"] == "trained twice"


def test_a_step_the_loop_skips_for_an_overflow_backs_the_scale_off(report):
    result = report["errors"]["loop_skips_overflow"]
    assert result["after"] == result["before"] / 2


def test_a_checkpoint_without_an_entry_loads_what_it_holds_when_not_strict(report):
    assert report["errors"]["load_missing_entry_not_strict"] == "no error"


def test_a_rank_failing_in_a_fabric_script_is_named_by_the_others(monkeypatch):
    """Rank 1's loop raises before its backward; rank 0, waiting in the gradient reduction, stops at once and names
    rank 1's error (reported through the interpreter's hook, so the ranks run as scripts do, not in the fork server)."""
    monkeypatch.setenv("LZ_FRESH_PROCESSES", "1")
    with pytest.raises(LaunchError) as failure:
        launch("tests.distributed.worker_fabric", "rank_fails", fresh=True, timeout=120)
    rank0 = str(failure.value).split("----- rank 1 -----")[0]
    assert "rank 1 raised RuntimeError: the data loader of rank 1 failed" in rank0
