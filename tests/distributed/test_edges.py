"""Full checkpoints across stages, a single process, bad input, a failing rank, and parameters or gradients in other
memory layouts than dense row-major (``memory_layouts.py``)."""

import pytest

from tests.launch import LaunchError, launch
from tests.tolerances import assert_reordered_fp32, assert_reordered_fp32_moments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def edges():
    return launch(
        "tests.distributed.worker_edges",
        "checkpoint",
        "sharded",
        "bad_input",
        "memory_layouts",
        "functional_sparse",
        "changed_dtype",
        "shared_block",
        "outside_hooks",
        "zero_dim",
        "written",
        "complex",
        "pruning",
        "integer",
        "integer_unset",
        "parameter_functions",
        nprocs=2,
    )


@pytest.fixture(scope="module")
def more_layouts():
    return launch("tests.distributed.worker_edges", "memory_layouts_rest", nprocs=2)["memory_layouts_rest"]


@pytest.mark.parametrize("case", ["stage2_to_stage3", "stage3_to_stage1"])
def test_full_checkpoint_is_plain_and_resumes_at_another_stage(edges, case):
    result = edges["checkpoint"][case]
    assert result["keys_match"]  # the module's own parameter names
    assert result["param_diff"] <= 1e-5
    assert result["optim_groups_match"]
    # torch.optim format, full tensors, plain AdamW's moments up to another order of the gradients' sums
    assert_reordered_fp32_moments(case, result["optim_state_diff"], result["saved_steps"], result["moment_scale"])
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
    assert "dot products over every parameter" in result["message"]  # why no declaration can shard it
    assert "first failure" not in result["message"]  # same error on both ranks: nothing to add


def test_model_without_trainable_parameters_is_refused(edges):
    result = edges["bad_input"]["frozen"]
    assert result["type"] == "ValueError"
    assert "no trainable parameters" in result["message"]


def test_a_lazy_layer_not_yet_run_is_refused_naming_it_and_the_way_out(edges):
    result = edges["bad_input"]["lazy"]
    assert result["type"] == "ValueError"
    assert result["message"].startswith("ZeroStrategy cannot shard extra.weight, extra.bias: uninitialized"), result
    assert "Run one forward on a sample batch before `fit`" in result["message"]


def test_a_layer_of_a_stage_3_unit_called_on_its_own_gets_a_hint_beside_torchs_error(edges):
    result = edges["bad_input"]["layer_of_a_unit"]
    assert result["type"] == "RuntimeError"
    assert "got mixed torch.Tensor and DTensor" in result["message"]
    assert "a unit's parameters are gathered only while the unit itself runs" in result["message"]
    assert "`wrap_policy` naming its class" in result["message"]


def test_a_penalty_over_the_parameters_in_training_step_at_stage_3_gets_the_ways_out(edges):
    """At stage 3 the sum meets the blocks' shards; the hint names the ways out."""
    result = edges["bad_input"]["penalty"]
    assert result["type"] == "RuntimeError"
    assert "got mixed torch.Tensor and DTensor" in result["message"]
    assert "use the optimizer's `weight_decay`" in result["message"] and "stage 1 or 2" in result["message"]


def test_a_module_sharded_by_a_stage_3_fit_is_refused_by_another_stage_and_taken_up_by_stage_3(edges):
    result = edges["bad_input"]["after_stage3"]
    assert result["stage2"]["type"] == "ZeroConfigError"
    message = result["stage2"]["message"]
    assert message.startswith("Regression was sharded in place by an earlier `ZeroStrategy(stage=3)` run"), message
    assert "load_from_checkpoint(Regression, path)" in message
    assert result["stage3"]["steps"] == 2


def _trained_as_under_ddp(runs: dict) -> None:
    for case, result in runs.items():
        if case.startswith("bf16"):
            # bf16 weights: ddp averages each bf16 gradient before summing it, ZeRO after; one rounding step of
            # weights below 1 apart
            assert result["diff_vs_ddp"] <= 2**-8, case
        else:
            _as_under_ddp(case, result)
        if case.startswith("sparse"):
            assert result["sparse_after_fit"] == [True, True], f"{case}: the layers get `sparse` back after fit"


def _as_under_ddp(case: str, result: dict) -> None:
    """The weights within reordered fp32 rounding of ``ddp``'s (the largest difference; ``tests/tolerances.py``)."""
    assert_reordered_fp32(case, result["diff_vs_ddp"], result["lr"], result["steps"])


def _each_as_under_ddp(runs: dict[str, dict]) -> None:
    for case, result in runs.items():
        _as_under_ddp(case, result)


def test_channels_last_transposed_two_dtype_sparse_embedding_and_0_dim_models_train_as_under_ddp(edges):
    """A channels-last CNN (stages 2-3), a parameter with transposed strides (stage 1), a float64 head (stage 3) and a
    bfloat16 body (stage 2) in a ``32-true`` run, ``sparse=True`` embeddings under SGD (stage 3) and Adagrad (stage
    2), a 0-dim temperature (stages 2-3): the weights ``ddp`` reaches with accumulation (and clipping but for the
    sparse ones)."""
    assert len(edges["memory_layouts"]) == 9
    _trained_as_under_ddp(edges["memory_layouts"])


@pytest.mark.full
def test_the_other_memory_layouts_at_the_other_stages(more_layouts):
    assert len(more_layouts) == 12
    _trained_as_under_ddp(more_layouts)


def test_a_0_dim_parameter_trains_offloaded_and_resumes_across_stages_and_formats(edges):
    """FSDP2 refuses 0-dim parameters, and stages 1-2 once did too: stage 3 keeps them whole and steps their one row
    on rank 0 as stages 1-2 do. The host step during backward, and a sharded stage-3 checkpoint resumed at stage 1 and
    a full stage-2 one at stage 3 (their optimizer state a row on one rank, saved whole), end on ``ddp``'s weights."""
    assert set(edges["zero_dim"]) == {"stage3_offload_unclipped", "stage3_sharded_to_stage1", "stage2_full_to_stage3"}
    _each_as_under_ddp(edges["zero_dim"])


def test_parameters_written_between_steps_reach_the_masters_and_the_shards(edges):
    """SwAV normalises its prototypes in place before each forward. With the optimizer offloaded the step used to
    overwrite that from the host masters (4.5e-2 from ``ddp`` at every stage); the written parameters are now taken
    back into their masters first, before the step and before the host steps during backward. A momentum teacher
    updated after every batch lost the updates made between the micro-batches of a step at stage 3 (5.9e-4 after 4
    steps): they went into the gathered copies an accumulation window keeps, which now go back to the shards. A VQ-VAE's
    EMA codebook, frozen parameters written inside ``training_step`` while the root is gathered, lost every write
    without accumulation (its codes then divided by ~1e-5: 1e5 from ``ddp``); every unit now takes what was written
    while it was gathered into its shards when it reshards."""
    assert len(edges["written"]) == 8
    _each_as_under_ddp(edges["written"])


def test_complex_parameters_stay_complex_under_bf16_mixed_and_train_offloaded(edges):
    """A Fourier neural operator's complex weights. Under bf16-mixed stages 1-2 made fp32 masters of them, dropping
    their imaginary parts (1.6e-2 from ``ddp`` after 4 SGD steps, where bf16's own rounding leaves 3e-4); offloaded,
    torch's fused host kernels refused them (``"fused_sgd_kernel" not implemented for 'ComplexFloat'``) at every stage;
    and the clipping norm dropped their imaginary parts (6.4e-7 here, clipped at 0.01). The differences compare complex
    values, imaginary parts included."""
    runs = edges["complex"]
    assert set(runs) == {"stage1_bf16", "stage2_offload_bf16", "stage3_bf16", "stage1_offload", "stage3_offload"}
    for name, result in runs.items():
        if name.endswith("bf16"):
            assert result["diff_vs_ddp"] <= 2e-3, name  # bf16's own rounding leaves 3e-4
        else:
            _as_under_ddp(name, result)


def test_integer_parameters_stay_whole_at_stage_3_and_the_sharded_class_loads_its_checkpoint(edges):
    """Quantized int8 weights beside their fp32 scales in one layer (QLoRA) and an index table beside an fp32 gain at
    the root: stage 3 refused both units (FSDP2 gathers one dtype a unit); integer parameters never have a gradient and
    now stay whole, as buffers do. Against ``ddp``, plain and with ``offload_params``, and a sharded checkpoint resumed
    at stage 2, and the layers built on the meta device; ``load_from_checkpoint(type(model), path)`` after the fit
    (FSDP2's class) loads the user's class. An integer parameter built on the meta device that nothing initialises
    (no NaN marks it) is refused naming it, as floating ones are; the fp32 gain the same module set in ``__init__``
    keeps its value (the module's tensors were all made anew, so it was named too)."""
    assert set(edges["integer"]) == {
        "stage3",
        "stage3_offload_params",
        "stage3_sharded_to_stage2",
        "loaded_by_the_sharded_class",
        "meta_stage3",
    }
    runs = dict(edges["integer"])
    assert runs.pop("loaded_by_the_sharded_class") == 0.0  # the saved weights read back: the same numbers
    _each_as_under_ddp(runs)
    error = edges["integer_unset"]
    assert error["type"] == "TypeError", error
    assert "Cannot materialise the meta-device model: ['QuantizedBase (codes)']" in error["message"], error["message"]


def test_functional_call_trains_as_under_ddp_at_stages_1_2_and_is_refused_at_stage_3_naming_the_unit(edges):
    """``torch.func.functional_call`` with moved weights: at stage 3 each unit's forward registered its gathered
    parameters over the tensors passed, so the call computed with the unit's own weights (2e-2 from ``ddp`` after
    3 steps, silently); now refused before it computes ([Note: functional calls on stage 3 units])."""
    runs = edges["parameter_functions"]
    _as_under_ddp("stage1", runs["stage1"])
    _as_under_ddp("stage2", runs["stage2"])
    error = runs["stage3"]
    assert error["type"] == "ShardedFunctionalCallError", error
    assert (
        "functional_call would replace `blocks.0.0.weight`, a parameter of the stage-3 unit `blocks.0`"
        in error["message"]
    ), error["message"]
    assert "Use stage 1 or 2 for functional calls" in error["message"]


def test_gradients_with_respect_to_parameters_in_training_step_train_at_stage_2_and_say_why_not_at_stage_3(edges):
    """A gradient-norm penalty (``torch.autograd.grad`` of the loss by the parameters, ``create_graph=True``): stage 2 as
    ``ddp``; at stage 3 torch's "appears to not have been used in the graph" gets a note saying why and what to use."""
    runs = edges["parameter_functions"]
    _as_under_ddp("grad_stage2", runs["grad_stage2"])
    error = runs["grad_stage3"]
    assert error["type"] == "RuntimeError" and "appears to not have been used in the graph" in error["message"], error
    assert "Under stage 3 a unit's parameters, as `module.parameters()` gives them" in error["message"]
    assert "need stage 1 or 2" in error["message"]


def test_model_pruning_trains_as_under_ddp_and_its_checkpoints_resume(edges):
    """Lightning's ``ModelPruning`` with its defaults resets the surviving weights to their initial values by assigning
    ``.data`` (the lottery ticket): stages 1-2 kept stepping views of the old storage and never updated the parameters
    again (1.6e-1 from ``ddp``, with and without masters). Its checkpoints hold the pruned weights under their own
    names beside optimizer state of the ``<name>_orig`` parameters, which a sharded checkpoint now saves under the
    same names, so it resumes. Stage 3 refuses the callback by name."""
    runs = edges["pruning"]
    refused = runs.pop("stage3")
    assert refused["type"] == "ZeroConfigError"
    assert "ModelPruning" in refused["message"] and "stage=1 or stage=2" in refused["message"]
    assert set(runs) == {"stage1", "stage2_half_offload", "stage2_sharded_mid_fit_to_stage1"}
    _each_as_under_ddp(runs)


@pytest.mark.full
def test_a_0_dim_parameter_elsewhere():
    runs = launch("tests.distributed.worker_edges", "zero_dim_rest", nprocs=2)["zero_dim_rest"]
    assert len(runs) == 5
    _each_as_under_ddp(runs)


def test_a_block_run_three_times_a_forward_trains_at_stage_3_as_under_ddp(edges):
    """ALBERT's sharing: the block's unit is reduced once per run. The later reductions used to add to a first one
    still in flight, which then overwrote them (the block's gradient came out at half its value), and the host step
    during backward stepped the block after its first reduction (each 6e-2 from ``ddp`` after 4 steps)."""
    assert set(edges["shared_block"]) == {"stage3", "stage3_offload_unclipped"}
    _each_as_under_ddp(edges["shared_block"])


def test_layers_run_other_than_through_call_train_at_stage_3_as_under_ddp(edges):
    """``block.forward(h)`` (SqueezeBERT's encoder) and an autoencoder's ``encode``/``decode`` skip the forward hooks:
    stage 3 made each block, and the autoencoder, a unit that FSDP2 never gathered ("aten.native_layer_norm.default
    got mixed torch.Tensor and DTensor", "aten.addmm.default ..."). Their layers are now the units, by default and
    under a ``wrap_policy`` naming the block class (checkpointing it too, which then keeps its activations, with a
    warning: ``unit/test_hook_bypasses.py``); their own gains stay with the root. The same holds where the source
    reaches the blocks through a local name, ``getattr`` and two attribute levels (``aliased_*``). A layer whose
    parameters its holder computes with (a tied head's ``F.linear(h, self.embed.weight)`` without a list of blocks;
    ``MultiheadAttention``'s ``out_proj`` under ``wrap_policy={nn.Linear}``) was a unit resharded or never gathered
    when they were used (the same error, without accumulation); it stays in the enclosing unit now."""
    assert set(edges["outside_hooks"]) == {
        "stage3",
        "stage3_policy_checkpointed",
        "stage2",
        "aliased_stage3",
        "aliased_stage3_policy",
        "read_stage3",
        "read_stage3_offload_params",
        "attention_stage3_linear_units",
        "autoencoder_stage3",
        "autoencoder_stage3_offload_params",
    }
    _each_as_under_ddp(edges["outside_hooks"])


@pytest.mark.full
def test_a_block_run_three_times_a_forward_elsewhere():
    runs = launch("tests.distributed.worker_edges", "shared_block_rest", nprocs=2)["shared_block_rest"]
    assert len(runs) == 3
    _each_as_under_ddp(runs)


def test_a_sparse_gradient_from_a_functional_call_is_refused_naming_the_parameter(edges):
    for stage, result in edges["functional_sparse"].items():
        assert result["type"] == "TypeError", stage
        assert "'tokens.weight' received a sparse gradient" in result["message"], stage
        assert "sparse=False" in result["message"], stage


def test_a_layer_that_changes_its_dtype_in_forward_is_refused_by_name_and_trains_once_listed_fp32(edges):
    """Held in bf16 it turned fp32 mid-step: at stages 1-2 gloo aborted both processes on the size mismatch
    (SIGABRT), at stage 3 FSDP2 asserted "expects uniform gradient dtype"."""
    for stage in ("stage1", "stage2", "stage3"):
        result = edges["changed_dtype"][stage]
        assert result["type"] == "TypeError", stage
        assert "'gate.proj." in result["message"] and "produced a torch.float32 gradient" in result["message"], stage
        assert "fp32_modules" in result["message"] and "self.dtype = torch.float32" in result["message"], stage
    for stage in ("stage1", "stage2", "stage3"):
        assert edges["changed_dtype"][f"{stage}_listed"]["type"] is None, stage


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
