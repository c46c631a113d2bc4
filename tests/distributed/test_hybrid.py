"""Hybrid sharding (shard inside a node, replicate across nodes) and hpZ on 4 CPU ranks through lightning.Trainer:
2 simulated nodes of 2 ranks (``num_nodes=2, devices=2``, ``shard_size="node"``) and one node of 4
(``devices=4, shard_size=2``), against plain single-process PyTorch (fp32), a single-process emulation of the
mixed arithmetic (bf16-mixed, 16-mixed), the ZeRO formulas with ``N -> k`` and the traffic formulas counted per
process group; Hugging Face GPT-2 with tied embeddings, pretrained weights, and checkpoints across flat and
hybrid runs, stages and world sizes. The torchrun multi-node run is in tests/integration/test_multinode.py.
"""

import pytest

from tests.distributed import worker_pretrained
from tests.distributed.grad_norm_probe import GradNormAgainstGathered
from tests.launch import launch
from tests.tolerances import (
    assert_as_reference,
    assert_reordered_fp32,
    assert_reordered_fp32_loss,
    assert_reordered_fp32_moments,
)

WORLD, K = 4, 2
pytestmark = [pytest.mark.slow, pytest.mark.many_ranks]

# Per-rank model-state bytes right after backward, fp32 AdamW, with N ranks replaced by the shard group's k.
FORMULAS = {1: lambda p, k: 8 * p + 8 * p / k, 2: lambda p, k: 4 * p + 12 * p / k, 3: lambda p, k: 16 * p / k}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hybrid")
    env = {"LZ_SHARED_DIR": str(directory)}
    one = launch("tests.distributed.worker_hybrid", "save_flat", nprocs=1, env=env)
    worker_pretrained.save_pretrained_files(directory / "pretrained")
    four = launch(
        "tests.distributed.worker_hybrid",
        "exact",
        "costs",
        "checkpoints",
        "pretrained",
        "directory_bytes",
        "resume_flat_save",
        "save_hybrid",
        nprocs=WORLD,
        nodes=2,
        env=env,
    )
    back = launch("tests.distributed.worker_hybrid", "resume_hybrid_save", nprocs=1, env=env)
    return {**one, **four, **back}


@pytest.fixture(scope="module")
def one_node():
    return launch("tests.distributed.worker_hybrid", "exact_one_node", nprocs=WORLD, nodes=1)


def _check_exact(result):
    assert result["steps"] == 4 and result["grad_steps"] == 4
    assert result["param_change"] > 1e-3, "the reference must actually train"
    assert result["grad_diff"] <= 1e-5
    assert result["param_diff"] <= 1e-5


@pytest.mark.parametrize("case", ["stage2", "stage3", "stage3_hpz"])
def test_two_nodes_match_plain_pytorch(nodes, case):
    """shard_size="node" (hpZ: secondary_shard_size="node"), accumulation 2, clipping by norm 0.5, 2 param
    groups and StepLR: the parameters and gradients of single-process PyTorch. hpZ is validated before training: the
    sanity check's forwards left every unit on its node-local shard, and the first accumulation window then crashed
    gathering from the node-local mesh it had cleared (FSDP2's "Expected mesh_info to be FSDPMeshInfo")."""
    _check_exact(nodes["exact"][case])


def test_hpz_leaves_a_layer_whose_weight_its_holder_computes_with_in_the_root(nodes):
    """hpZ makes each direct child of the root holding parameters a unit of its own; a tied head computing with the
    embedding's weight (``F.linear(h, self.embed.weight)``) then met its shards ("aten.mm.default got mixed
    torch.Tensor and DTensor"). Against ``ddp`` on the same 4 ranks, without accumulation."""
    result = nodes["exact"]["stage3_hpz_tied_head"]
    assert_reordered_fp32("stage3_hpz_tied_head", result["diff_vs_ddp"], result["lr"], result["steps"])


def _check_mixed(result):
    """As tests/distributed/test_precision.py: masters equal the emulation, the loss tracks fp32 training."""
    assert len(result["losses"]) == 20
    assert result["master_change"] > 1e-2
    # the emulation does our arithmetic on tensors of its own, in another process: reordered fp32
    assert_reordered_fp32("masters", result["master_diff"], result["lr"], result["steps"])
    assert_reordered_fp32_loss("losses", result["emulated_loss_diff"], max(result["losses"]), result["steps"])
    assert result["skipped"] == result["emulated_skipped"]
    assert result["loss_diff"] <= {"bf16-mixed": 5e-3, "16-mixed": 1e-3}[result["precision"]]


def _check_hugging_face(case, result):
    assert result["steps"] == 3 and result["change"] > 1e-3
    assert_as_reference(case, result, "32-true" if "32-true" in case else "mixed")
    if case.startswith("gpt2"):
        assert result["tied"], "lm_head and wte stay tied"


@pytest.mark.parametrize("case", ["stage3_bf16-mixed"])
def test_two_nodes_in_mixed_precision_match_the_emulation(nodes, case):
    """The demo GPT, 20 steps with clipping, 2 param groups and warmup: the masters of a single process doing
    the same arithmetic (each shard group's sum held, then summed across groups in the reduce dtype)."""
    _check_mixed(nodes["exact"][case])


@pytest.mark.parametrize("case", ["gpt2_stage3_bf16-mixed"])
def test_two_nodes_train_hugging_face_gpt2_with_tied_embeddings(nodes, case):
    _check_hugging_face(case, nodes["exact"][case])


def test_fits_one_after_another_build_their_process_groups_once(nodes):
    """[Note: groups live as long as the world]: the second and third fit reuse the first's mesh and the
    asynchronous saves' group."""
    first, *later = nodes["exact"]["groups_kept"]["groups"]
    assert later == [first, first]


def test_grad_norm_adds_each_parameters_rows_over_its_shard_group_once(nodes):
    """Stage 2 on 2 simulated nodes: each parameter's norm is its full gradient's, not a replica's double count."""
    GradNormAgainstGathered.check(nodes["exact"]["grad_norms_stage2"], steps=2, accumulate=2)


@pytest.mark.full
@pytest.mark.parametrize("case", ["stage1", "stage2", "stage3"])
def test_one_node_of_four_with_shard_size_two_matches_plain_pytorch(one_node, case):
    _check_exact(one_node["exact_one_node"][case])


@pytest.fixture(scope="module")
def full_matrix(tmp_path_factory):
    report = launch(
        "tests.distributed.worker_hybrid",
        "exact_full",
        "costs_full",
        "checkpoints_full",
        nprocs=WORLD,
        nodes=2,
        env={"LZ_SHARED_DIR": str(tmp_path_factory.mktemp("hybrid_full"))},
    )
    return {**report["exact_full"], **report["costs_full"], "checkpoints": report["checkpoints_full"]}


@pytest.mark.full
@pytest.mark.parametrize(
    "case",
    [
        "stage1",
        "stage2_unused_parameter",
        "stage1_no_overlap",
        "stage2_reduce_every_microbatch",
        "stage3_unused_parameter",
        "stage2_offload_optimizer",
        "stage3_offload_params",
        "stage3_hpz_offload_params",
    ],
)
def test_more_hybrid_configurations_match_plain_pytorch(full_matrix, case):
    _check_exact(full_matrix[case])


@pytest.mark.full
@pytest.mark.parametrize(
    "case", ["stage1_16-mixed", "stage2_bf16-mixed", "stage1_bf16-mixed", "stage2_16-mixed", "stage3_16-mixed"]
)
def test_more_mixed_precision_configurations_match_the_emulation(full_matrix, case):
    _check_mixed(full_matrix[case])


@pytest.mark.full
def test_hpz_in_bf16_mixed_ends_bit_for_bit_where_flat_zero3_ends(full_matrix):
    result = full_matrix["stage3_hpz_bf16-mixed_vs_flat"]
    assert result["steps"] == 10 and result["diff"] == 0.0


@pytest.mark.full
@pytest.mark.parametrize(
    "case",
    [
        "gpt2_stage2_32-true",
        "gpt2_stage1_32-true",
        "gpt2_stage3_32-true",
        "llama_stage1_32-true",
        "llama_stage3_32-true",
        "llama_stage3_hpz_32-true",
    ],
)
def test_more_hugging_face_configurations(full_matrix, case):
    _check_hugging_face(case, full_matrix[case])


def _check_memory(result, stage):
    assert result["shard_size"] == K
    assert result["bytes"] == pytest.approx(FORMULAS[stage](result["params"], K), rel=0.02)


def test_model_state_bytes_follow_the_formulas_with_the_shard_size(nodes):
    _check_memory(nodes["costs"]["memory_stage3"], 3)


@pytest.mark.full
@pytest.mark.parametrize("stage", [1, 2])
def test_model_state_bytes_at_stages_1_and_2(full_matrix, stage):
    _check_memory(full_matrix[f"memory_stage{stage}"], stage)


def test_hpz_holds_a_node_local_parameter_copy_between_forward_and_backward(nodes):
    """After backward hpZ holds what flat ZeRO-3 holds; between forward and backward it adds 4P/s (fp32, s=2)."""
    flat, hpz = nodes["costs"]["memory_stage3_flat"], nodes["costs"]["memory_stage3_hpz"]
    params = flat["params"]
    assert hpz["bytes"] == pytest.approx(FORMULAS[3](params, WORLD), rel=0.02)
    assert hpz["after_forward"] - flat["after_forward"] == pytest.approx(4 * params / K, rel=0.02)


def _traffic(result):
    micro = result["micro"][-1]  # the last micro-batch: its backward reduces, its step gathers
    inter = {k: v for g in micro["by_group"].values() if g["inter_node"] for k, v in g["elements_by_kind"].items()}
    intra = {k: v for g in micro["by_group"].values() if not g["inter_node"] for k, v in g["elements_by_kind"].items()}
    return micro, inter, intra


def _check_stage_1_2_traffic(costs: dict, stage: int) -> None:
    """Inside a node: reduce-scatter P and all-gather P (and the used-parameter flags); across nodes only the
    all-reduce of this rank's gradient shard, 2P/k, plus the flags: against 2P for flat sharding."""
    result = costs[f"comm_stage{stage}"]
    p, shard, flags = result["params"], result["shard_numel"], result["tensors"]
    assert shard * K == p  # the test model's rows split evenly
    micro, inter, intra = _traffic(result)
    assert intra == {"reduce_scatter": p, "all_gather": p, "all_reduce": 2 * flags}
    assert inter == {"all_reduce": 2 * shard + 2 * flags}
    assert micro["elements_inter_node"] == 2 * p // K + 2 * flags
    flat_micro, flat_inter, flat_intra = _traffic(costs["comm_stage2_flat"])
    assert flat_intra == {} and flat_inter == {"reduce_scatter": p, "all_gather": p, "all_reduce": 2 * flags}
    # ZeroMonitor logs the same split (fp32: 4 bytes an element)
    assert result["monitor_inter_node_MiB"] * 2**20 == micro["bytes_inter_node"] == 4 * (2 * p // K + 2 * flags)
    assert result["monitor_MiB"] * 2**20 == micro["bytes"]


def test_stage_2_traffic_per_group(nodes):
    _check_stage_1_2_traffic(nodes["costs"], 2)


@pytest.mark.full
def test_stage_1_traffic_per_group(full_matrix):
    _check_stage_1_2_traffic(full_matrix, 1)


def test_stage_3_traffic_per_group(nodes):
    """Inside a node: all-gathers in forward and backward (2P) and the reduce-scatter (P); across nodes the
    shard all-reduce, 2P/k; in both, the used-parameter flags (one per tensor, as at stages 1-2)."""
    result = nodes["costs"]["comm_stage3"]
    p, flags = result["params"], result["tensors"]
    _, inter, intra = _traffic(result)
    assert intra == {"all_gather": 2 * p, "reduce_scatter": p, "all_reduce": 2 * flags}
    assert inter == {"all_reduce": 2 * p // K + 2 * flags}


@pytest.mark.parametrize("model", ["comm_stage3_hpz", pytest.param("comm_gpt_hpz", marks=pytest.mark.full)])
def test_hpz_backward_gather_stays_inside_the_node(request, model):
    """hpZ over 2 nodes: forward's all-gather and the reduce-scatter cross nodes (P each); backward's
    all-gather runs inside the node (P). The GPT has parameters outside its blocks (a tied embedding and head,
    the final norm) and a training_step that calls the module's forward, nested in Lightning's call of the root."""
    costs = (
        request.getfixturevalue("nodes")["costs"]
        if model == "comm_stage3_hpz"
        else request.getfixturevalue("full_matrix")
    )
    _, inter, intra = _traffic(costs[model])
    p, flags = costs[model]["params"], costs[model]["tensors"]
    assert inter == {"all_gather": p, "reduce_scatter": p, "all_reduce": 2 * flags}
    assert intra == {"all_gather": p}


def _check_resume(result):
    assert result["steps"] == 4
    # saved at another stage and sharding: the first epoch's sums in another order (tests/tolerances.py)
    assert_reordered_fp32("resumed", result["param_diff"], result["lr"], result["steps"])
    assert_reordered_fp32_moments("resumed", result["optim_diff"], result["steps"], result["moment_scale"])


@pytest.mark.parametrize(
    "pair", ["3{'shard_size': 'node'}->1{'shard_size': 'node'}", "3{'secondary_shard_size': 2}->2{'shard_size': 2}"]
)
def test_checkpoints_resume_exactly_across_hybrid_flat_shard_sizes_and_stages(nodes, pair):
    """1 epoch with ModelCheckpoint (sharded), a new Trainer resumes at another stage / sharding for epoch 2."""
    _check_resume(nodes["checkpoints"][pair])


@pytest.mark.full
@pytest.mark.parametrize("pair", ["2{'shard_size': 'node'}->3{}", "1{}->3{'shard_size': 'node'}"])
def test_checkpoints_resume_exactly_between_hybrid_and_flat(full_matrix, pair):
    _check_resume(full_matrix["checkpoints"][pair])


@pytest.mark.parametrize("stage", [2, 3])
def test_pretrained_weights_load_into_a_hybrid_run(nodes, stage):
    """``init_weights`` (a ``save_pretrained`` GPT-2): each rank holds its shard group's rows of every tensor."""
    result = nodes["pretrained"][f"stage{stage}"]
    assert result["steps"] == 3 and result["checked"] > 0 and result["tied"]
    assert result["diff"] == 0.0


@pytest.mark.parametrize("name", ["sharded", "full.ckpt"])
def test_checkpoints_cross_world_sizes_both_ways(nodes, name):
    """One process saves, 4 hybrid ranks resume; 4 hybrid ranks save, one process resumes."""
    for case in ("resume_flat_save", "resume_hybrid_save"):
        result = nodes[case][name]
        assert result["param_diff"] == 0.0 and result["optim_diff"] == 0.0
        assert result["steps"] == 5


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_checkpoint_writes_each_row_once(nodes, stage):
    """DCP keeps one copy of rows the replica groups share: the hybrid directory is no larger than the flat one,
    whose ranks hold disjoint rows (2 copies would double the ~150 KB of weights and AdamW state)."""
    sizes = nodes["directory_bytes"]
    assert sizes[f"hybrid{stage}"] <= sizes[f"flat{stage}"]
