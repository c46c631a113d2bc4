"""Lightning features a user reaches for after switching ``strategy="ddp"`` to ZeroStrategy, run through
lightning.Trainer on 2 CPU ranks: ``Tuner.lr_find`` at every stage (its checkpoint is written before the optimizer has
state), and getting a trained module back in one plain process from a sharded checkpoint."""

from pathlib import Path

import pytest
import torch

from lightning_zero import load_from_checkpoint
from lightning_zero.demo.gpt import GPTLightningModule
from tests.launch import launch
from tests.tolerances import FP32_ROUNDING, assert_reordered_fp32, assert_reordered_fp32_loss

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("features")
    report = launch(
        "tests.distributed.worker_lightning_features",
        "lr_find",
        "checkpoints",
        nprocs=2,
        env={"LZ_SHARED_DIR": str(directory)},
    )
    return report


@pytest.mark.parametrize("case", ["stage1", "stage2", "stage3", "stage2_full"])
def test_lr_find_works_and_matches_ddp(runs, case):
    """The same loss curve, suggestion and parameters after ``fit`` as Lightning ``ddp`` on the same module."""
    result, ddp = runs["lr_find"][case], runs["lr_find"]["ddp"]
    assert result["steps"] == 3 and len(result["losses"]) == 20
    assert result["suggestion"] == ddp["suggestion"] and result["learning_rate"] == ddp["suggestion"]
    # the search's 20 steps, then fit's 3 from the restored weights at the suggestion
    assert_reordered_fp32_loss(case, result["loss_diff_vs_ddp"], max(ddp["losses"]), len(ddp["losses"]))
    assert_reordered_fp32(case, result["param_diff_vs_ddp"], result["lr"], result["steps"])


@pytest.mark.parametrize("case", ["stage2", "stage3", "stage3_full"])
def test_a_trained_module_comes_back_in_one_process(runs, case):
    """``lightning_zero.load_from_checkpoint(MyModule, path)``: no process group, any stage, a sharded directory or a
    full file; the weights the run ended with, its hyperparameters (overridable), ``configure_model`` called."""
    path = Path(runs["checkpoints"][case])
    expected = torch.load(path.with_name(f"{case}.weights.pt"), weights_only=True)
    module = load_from_checkpoint(GPTLightningModule, path)
    assert isinstance(module, GPTLightningModule) and module.hparams.n_embd == 32
    state = module.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    overridden = load_from_checkpoint(GPTLightningModule, path, learning_rate=0.5)
    assert overridden.hparams.learning_rate == 0.5


def test_lightnings_own_loader_still_cannot_open_a_directory(runs):
    """Lightning opens the path as one file; this pins the failure the README points around."""
    with pytest.raises(IsADirectoryError):
        GPTLightningModule.load_from_checkpoint(runs["checkpoints"]["stage2"])


@pytest.fixture(scope="module")
def averaging_runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("averaging")
    return launch(
        "tests.distributed.worker_lightning_features",
        "swa",
        "ema_resumed",
        "averaging_pipeline",
        "averaging_bf16",
        "averaging_batchnorm",
        "averaging_unfreezing",
        nprocs=2,
        env={"LZ_SHARED_DIR": str(directory)},
    )


@pytest.fixture(scope="module")
def averaging_rest(tmp_path_factory):
    directory = tmp_path_factory.mktemp("averaging_rest")
    return launch(
        "tests.distributed.worker_lightning_features",
        "swa_rest",
        "ema_resumed_rest",
        "averaging_pipeline_rest",
        "averaging_bf16_rest",
        "averaging_unfreezing_rest",
        "averaging_batchnorm_rest",
        "averaging_delayed",
        nprocs=2,
        env={"LZ_SHARED_DIR": str(directory)},
    )


def _check_swa(runs: dict, case: str) -> None:
    """Lightning's ``StochasticWeightAveraging`` (from epoch 2 of 4) ends with the weights ``ddp`` ends with; at stage 3
    it averages the sharded parameters, and a run resumed from a checkpoint taken while averaging ends there too."""
    result = runs[case]
    assert result["epochs"] == 4 and result["averaged"] == runs["ddp"]["averaged"] == 3
    assert_reordered_fp32(case, result["diff_vs_ddp"], result["lr"], result["steps"])


@pytest.mark.parametrize("case", ["stage1", "stage3_resumed"])
def test_stochastic_weight_averaging_equals_ddp(averaging_runs, case):
    _check_swa(averaging_runs["swa"], case)


@pytest.mark.full
@pytest.mark.parametrize("case", ["stage2", "stage3", "stage3_configure_model", "stage2_resumed"])
def test_stochastic_weight_averaging_at_the_other_stages(averaging_rest, case):
    _check_swa(averaging_rest["swa_rest"], case)


def _check_ema_resumed(runs: dict, case: str) -> None:
    """``EMAWeightAveraging`` resumed from the checkpoint after epoch 1 of 3 ends with the weights (the average) and
    the last validation loss (the average swapped in) of the uninterrupted run, bit for bit: the module resumes from
    the trained weights and the callback from the average and its count. Each rank holds half the average. Without
    offload that is also ``ddp``'s end; offloaded, the host's fused AdamW kernel rounds a key projection's bias (whose
    gradient is zero but for rounding: softmax ignores it) differently from ddp's, which no output sees."""
    result = runs[case]
    assert result["epochs"] == 3 and result["averaged"] == runs["ddp"]["averaged"] == 18
    if not case.endswith("to_ddp"):  # this rank's rows of the average, not a whole model as under ddp (2 ranks)
        assert result["average_bytes"] <= 0.55 * runs["ddp"]["average_bytes"]
    if result["same_strategy"]:  # saved and resumed under the uninterrupted run's strategy: its arithmetic
        assert result["diff_vs_uninterrupted"] == 0.0 and result["val_loss_diff_vs_uninterrupted"] == 0.0
    else:  # the first epoch under another strategy
        assert_reordered_fp32(case, result["diff_vs_uninterrupted"], result["lr"], result["steps"])
        assert_reordered_fp32_loss(case, result["val_loss_diff_vs_uninterrupted"], result["val_loss"], result["steps"])
    assert_reordered_fp32_loss(case, result["val_loss_diff_vs_ddp"], result["val_loss"], result["steps"])
    if "offload" not in case:
        assert_reordered_fp32(case, result["diff_vs_ddp"], result["lr"], result["steps"])


@pytest.mark.parametrize("case", ["stage3", "ddp_to_stage3"])
def test_ema_resumes_where_the_uninterrupted_run_goes(averaging_runs, case):
    _check_ema_resumed(averaging_runs["ema_resumed"], case)


@pytest.mark.full
@pytest.mark.parametrize(
    "case",
    ["stage2_offload_full", "stage2_async", "stage3_full", "stage1_offload", "stage3_to_stage2", "stage2_full_to_ddp"],
)
def test_ema_resumes_at_the_other_stages_and_across_strategies(averaging_rest, case):
    _check_ema_resumed(averaging_rest["ema_resumed_rest"], case)


def _check_witnessed(runs: dict, case: str) -> None:
    """Both callbacks end with the average of the weights they read, and a run resumed from the checkpoint after
    epoch 1 of 3 ends where the uninterrupted one does."""
    result = runs[case]
    assert result["updates"] == (result["steps"] if case.startswith("ema") else 2)
    assert result["diff_vs_witness"] <= 1e-5
    assert result["resumed_diff"] == 0.0  # resumed under the same strategy: the uninterrupted run's arithmetic


@pytest.mark.parametrize("case", ["ema_stage3"])
def test_weight_averaging_under_pipeline_stages(averaging_runs, case):
    """Under 2 pipeline stages another stage's parameters are meta on each rank."""
    _check_witnessed(averaging_runs["averaging_pipeline"], case)


@pytest.mark.full
@pytest.mark.parametrize("case", ["swa_stage3", "ema_stage1", "swa_stage1"])
def test_weight_averaging_under_pipeline_stages_elsewhere(averaging_rest, case):
    _check_witnessed(averaging_rest["averaging_pipeline_rest"], case)


@pytest.mark.full
@pytest.mark.parametrize("case", ["swa_stage2", "ema_stage1"])
def test_weight_averaging_under_the_delayed_update_averages_every_update_taken(averaging_rest, case):
    """``offload_step_delay=1``: the callbacks average the masters each update leaves, and a resumed run ends where
    the uninterrupted one does (EMA under the delay at stage 2 is also in ``test_offload.py``)."""
    _check_witnessed(averaging_rest["averaging_delayed"], case)


@pytest.mark.parametrize("case", ["ema_stage2"])
def test_weight_averaging_under_bf16_mixed_averages_the_fp32_weights(averaging_runs, case):
    """Stages 1-2 compute with bf16 working copies: the callbacks average the fp32 masters instead, and a validation
    swap or the final copy never rounds the average to bf16."""
    _check_witnessed(averaging_runs["averaging_bf16"], case)


@pytest.mark.full
@pytest.mark.parametrize(
    "case", ["swa_stage2", "ema_stage1_offload", "ema_stage2_full", "swa_stage1", "ema_pipeline_stage1", "ema_stage3"]
)
def test_weight_averaging_under_bf16_mixed_elsewhere(averaging_rest, case):
    _check_witnessed(averaging_rest["averaging_bf16_rest"], case)


@pytest.mark.parametrize("case", ["ema_stage2", "swa_stage2"])
def test_weight_averaging_follows_parameters_unfrozen_during_fit(averaging_runs, case):
    """At stages 1-2 a parameter unfrozen after averaging began gets rows of its own, and its average (whole while
    it was frozen) becomes this rank's rows of it."""
    result = averaging_runs["averaging_unfreezing"][case]
    assert result["updates"] == (result["steps"] if case.startswith("ema") else 2)
    _averaged_as_witnessed(case, result)


def _averaged_as_witnessed(case: str, result: dict) -> None:
    """The witness averages the same run's whole weights, the callback this rank's rows (EMA: one ``_foreach_lerp_``
    over the rows against one over each whole tensor): each update's few roundings, up to 3 an element on either
    side, of the weights' size, and nothing of the training (tests/tolerances.py's unit roundoff)."""

    bound = 6 * result["updates"] * FP32_ROUNDING * result["weight_scale"]
    assert result["diff_vs_witness"] <= bound, f"{case}: {result['diff_vs_witness']:.3g} > {bound:.3g}"


@pytest.mark.full
@pytest.mark.parametrize("case", ["ema_stage1", "swa_stage1", "ema_stage3", "swa_stage3"])
def test_weight_averaging_follows_parameters_unfrozen_during_fit_elsewhere(averaging_rest, case):
    result = averaging_rest["averaging_unfreezing_rest"][case]
    assert result["updates"] == (result["steps"] if case.startswith("ema") else 2)
    _averaged_as_witnessed(case, result)


@pytest.mark.parametrize("case", ["ema_stage3", "swa_stage3"])
def test_weight_averaging_with_batchnorm_matches_ddp(averaging_runs, case):
    """BatchNorm statistics: each rank averages its own (EMA's ``use_buffers``) and evaluation runs on rank 0's, as
    under ``ddp``, whose first forward broadcasts them: the same state and validation metrics. The metric after
    SWA's BatchNorm epoch is left out: ``ddp`` runs that epoch as one accumulation window, in which it broadcasts
    no buffers, and then validates each rank on its own statistics, where every rank here uses rank 0's."""
    _check_batchnorm(averaging_runs["averaging_batchnorm"][case], case)


@pytest.mark.full
@pytest.mark.parametrize("case", ["ema_stage2", "swa_stage2"])
def test_weight_averaging_with_batchnorm_matches_ddp_at_stage_2(averaging_rest, case):
    _check_batchnorm(averaging_rest["averaging_batchnorm_rest"][case], case)


def _check_batchnorm(result: dict, case: str) -> None:
    assert_reordered_fp32(case, result["diff_vs_ddp"], result["lr"], result["steps"])
    compared = result["val_mse_diffs"][:-1] if case.startswith("swa") else result["val_mse_diffs"]
    assert len(compared) >= 4
    assert_reordered_fp32_loss(case, max(compared), max(result["val_mse"]), result["steps"])


@pytest.fixture(scope="module")
def compile_runs():
    return launch("tests.distributed.worker_lightning_features", "compile", nprocs=2)["compile"]


@pytest.fixture(scope="module")
def inductor_runs():
    return launch("tests.distributed.worker_lightning_features", "compile_inductor", nprocs=2)["compile_inductor"]


@pytest.fixture(scope="module")
def compile_rest():
    return launch("tests.distributed.worker_lightning_features", "compile_rest", nprocs=2)["compile_rest"]


def _check_compiled(result: dict) -> None:
    """``ZeroStrategy(compile={"backend": "aot_eager"})`` (and blocks compiled in ``configure_model``) really compile
    (dynamo graphs) and end where eager ``ddp`` ends: capture changes nothing under the sharding hooks."""
    assert result["steps"] == 3 and result["graphs"] >= 2
    assert result["diff_vs_ddp_eager"] <= 1e-5 and result["diff_vs_ddp_compiled"] <= 1e-5


@pytest.mark.parametrize("case", ["stage3", "stage3_configure_model"])
def test_compiled_blocks_train_as_eager(compile_runs, case):
    _check_compiled(compile_runs[case])


@pytest.mark.full
@pytest.mark.parametrize("case", ["stage1", "stage2"])
def test_compiled_blocks_train_as_eager_at_stages_1_and_2(compile_rest, case):
    _check_compiled(compile_rest[case])


def test_compiling_the_whole_model_is_refused_by_lightning_with_its_reason(compile_runs):
    assert "Only SingleDeviceStrategy, DDPStrategy, FSDPStrategy support compilation" in compile_runs["refused"]


@pytest.mark.full
@pytest.mark.parametrize("case", ["stage2", "stage3", "stage3_configure_model"])
def test_inductor_blocks_equal_ddp_with_the_same_blocks_compiled(inductor_runs, case):
    """Inductor's fused kernels round differently from eager (7e-5 after 3 steps, under ddp as under ZeRO); the
    same blocks compiled under ``ddp`` end exactly where ZeRO ends."""
    result = inductor_runs[case]
    assert result["graphs"] >= 2 and result["diff_vs_ddp_compiled"] <= 1e-5
    assert result["diff_vs_ddp_eager"] <= 1e-3


@pytest.fixture(scope="module")
def unfreezing_runs():
    return launch("tests.distributed.worker_lightning_features", "unfreezing", nprocs=2)["unfreezing"]


@pytest.mark.parametrize("case", ["stage1", "stage2", "stage3", "stage1_offload", "stage2_offload", "stage3_offload"])
def test_unfreezing_and_freezing_during_fit_match_plain_pytorch(unfreezing_runs, case):
    """``BaseFinetuning`` freezes a backbone before ``fit``, unfreezes it into a new param group at epoch 1
    (``unfreeze_and_add_param_group``) and the test freezes the head at epoch 2: the parameters of plain PyTorch
    doing the same. Stages 1-2 grow their shard layout once, when the backbone joins; stage 3 with the optimizer
    offloaded steps the backbone (no host master) where it is, beside the host's parts."""
    result = unfreezing_runs[case]
    assert result["steps"] == 12 and result["backbone_change"] > 1e-2
    assert result["diff"] <= 1e-5
    if not case.startswith("stage3"):
        assert [g["params"] for g in result["growths"]] == [4]


def test_ddp_does_not_average_parameters_frozen_when_it_wrapped_the_model(unfreezing_runs):
    """The anchor: Lightning ``ddp`` builds its reducer when it wraps the model, so a backbone frozen then is never
    averaged across ranks after unfreezing, and the run leaves plain PyTorch's path (pinned so that this stays true
    of the anchor, not of us)."""
    assert unfreezing_runs["ddp"]["diff"] > 1e-2
