"""Matrix optimizers (Muon, Adafactor, a MuonWithAuxAdam-style mix) under ZeRO stages 1-3 through lightning.Trainer
on 2 CPU ranks (and 4, as 2 simulated nodes): each whole parameter stepped on an owner rank, against plain
single-process PyTorch with the same optimizers; state on the owners only; checkpoints across world sizes and stages.
"""

import pytest

from tests.launch import launch

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("matrix")
    return launch(
        "tests.distributed.worker_matrix",
        "exact",
        "manual",
        "variants",
        nprocs=2,
        env={"LZ_SHARED_DIR": str(directory)},
    )


@pytest.fixture(scope="module")
def hf():
    return launch("tests.distributed.worker_matrix", "hf", nprocs=2)["hf"]


@pytest.fixture(scope="module")
def four():
    return launch("tests.distributed.worker_matrix", "four_ranks", nprocs=4, nodes=2)["four_ranks"]


@pytest.fixture(scope="module")
def crossed(tmp_path_factory):
    """One checkpoint through three launches: stage 2 on 2 ranks -> stage 3 on 1 rank -> stage 2 on 2 ranks."""
    env = {"LZ_SHARED_DIR": str(tmp_path_factory.mktemp("crossed"))}
    out = {}
    for group, nprocs in (("save_s2", 2), ("resume_s3", 1), ("resume_s2", 2)):
        out.update(launch("tests.distributed.worker_matrix", group, nprocs=nprocs, env=env))
    return out


def _assert_exact(result, newton_schulz=True, replicas=1):
    assert result["steps"] == 4
    assert result["param_change"] > 1e-2, "the reference must actually train"
    assert result["param_diff"] <= TOL
    assert result["ranks_agree"]
    if newton_schulz:  # every hidden matrix orthogonalised at every step, once, on its owner, from its full shape
        assert sum(result["ns_calls"]) == result["matrices"] * result["steps"] * replicas
        assert result["ns_shapes"] == result["matrix_shapes"]
        assert all(n > 0 for n in result["ns_calls"]), "the matrices are spread over the ranks"
    assert sum(result["owned_elements"]) > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["aux_adam", "adafactor"])
def test_matrix_optimizers_match_plain_pytorch(runs, stage, kind):
    """Accumulation 2, clipping by global norm, StepLR, two param groups: fp32 parameters within 1e-5 after 4 steps."""
    _assert_exact(runs["exact"][f"stage{stage}_{kind}"], newton_schulz=kind == "aux_adam")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_manual_optimization_with_muon_and_adamw(runs, stage):
    """Two optimizers in manual optimization (accumulation and per-optimizer clipping written by the user)."""
    fp32 = runs["manual"][f"stage{stage}_fp32_muon"]
    assert fp32["param_change"] > 1e-2 and fp32["param_diff"] <= TOL
    assert sum(fp32["ns_calls"]) == 4 * 4  # 4 hidden matrices x 4 steps, each once, on its owner
    torch_muon, ddp = runs["manual"][f"stage{stage}_torch_muon"], runs["manual"]["ddp_torch_muon"]
    # torch's Muon orthogonalises in bf16: judged against Lightning ddp's own distance from one process.
    assert torch_muon["param_diff"] <= max(2 * ddp["param_diff"], 2e-4)
    assert sum(torch_muon["ns_calls"]) == 4 * 4 and all(n > 0 for n in torch_muon["ns_calls"])
    assert runs["manual"]["ddp_fp32_muon"]["param_diff"] <= TOL


@pytest.mark.parametrize("case", ["stage2_bf16", "stage3_bf16"])
def test_mixed_precision_steps_fp32_masters_of_the_owned_matrices(runs, case):
    """bf16-mixed: equal to the step-by-step emulation of the mixed arithmetic (fp32 masters, Muon on them)."""
    _assert_exact(runs["variants"][case])


@pytest.mark.parametrize("case", ["stage2_offload", "stage3_offload_params", "stage3_offload_optimizer"])
def test_offloaded_owner_state_is_exact(runs, case):
    _assert_exact(runs["variants"][case], newton_schulz="adafactor" not in case and case != "stage3_offload_params")


@pytest.mark.parametrize("case", ["bytes_stage2", "bytes_stage3", "bytes_stage2_offload"])
def test_whole_state_lives_only_on_owners(runs, case):
    """Muon momentum: exactly the elements the ownership plan gives each rank (1/N each here, imbalance 1.0);
    AdamW moments: two per element of this rank's rows."""
    result = runs["variants"][case]
    assert result["whole"] == result["owned_elements"]
    assert sum(result["whole"]) == result["matrix_elements"]
    assert max(result["whole"]) <= result["imbalance"] * result["matrix_elements"] / 2 + 1e-9
    assert sum(result["sharded"]) == 2 * result["elementwise_elements"]


@pytest.mark.parametrize("case", ["resume_stage3_sharded", "resume_stage2_full", "resume_stage1_full_adafactor"])
def test_resume_is_exact(runs, case):
    result = runs["variants"][case]
    assert result["steps"] == [4, 4]
    assert result["diff"] == 0.0  # resumed at the same stage: the uninterrupted run's arithmetic in the same processes


def test_checkpoint_crosses_world_sizes_and_stages(crossed):
    """Saved at stage 2 on 2 ranks, resumed at stage 3 on 1 rank, then back at stage 2 on 2 ranks: each continuation
    equals plain PyTorch resumed from the same full state (every Muon momentum found whole)."""
    assert crossed["save_s2"]["steps"] == 2
    assert crossed["resume_s3"]["steps"] == 6 and crossed["resume_s3"]["diff"] <= TOL
    assert crossed["resume_s3"]["whole_state_keys"] == [0, 1, 2, 3]
    # consolidating the 2-rank directory gives the optimizer state the run held, whole and sharded entries alike
    assert crossed["resume_s3"]["consolidated_keys_equal"] and crossed["resume_s3"]["consolidated_diff"] == 0.0
    assert crossed["resume_s2"]["steps"] == 8 and crossed["resume_s2"]["diff"] <= TOL


@pytest.mark.many_ranks
@pytest.mark.parametrize(
    "case", ["stage3_aux_adam", "stage2_adafactor", "stage2_hybrid_aux_adam", "stage3_hybrid_adafactor"]
)
def test_four_ranks_and_hybrid_sharding(four, case):
    """Hybrid: owners inside each shard group of 2; both replica groups step every matrix."""
    result = four[case]
    hybrid = "hybrid" in case
    _assert_exact(result, newton_schulz="aux_adam" in case, replicas=2 if hybrid else 1)
    assert len(result["owned_elements"]) == (2 if hybrid else 4)


def test_an_undeclared_optimizer_is_refused_with_both_ways_out(runs):
    message = runs["variants"]["refusal"]["message"]
    assert "Undeclared" in message and "elementwise_optimizers=(Undeclared,)" in message
    assert "matrix_optimizers=(Undeclared,)" in message


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("optimizer", ["adafactor", "aux_adam"])
@pytest.mark.parametrize("stage", [2, 3])
def test_hugging_face_models_train_exactly(hf, kind, optimizer, stage):
    """GPT-2's Conv1D matrices and tied embeddings, Llama's attention and MLP: the same parameters as one process
    (accumulation 2, clipping, a warmup schedule; the tie kept)."""
    result = hf[f"{kind}_{optimizer}_stage{stage}"]
    assert result["steps"] == 3 and result["change"] > 1e-3
    assert result["diff"] <= TOL
    if kind == "gpt2":
        assert result["tied"]
