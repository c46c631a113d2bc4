"""Ulysses sequence parallelism inside ``lightning.Trainer`` (gloo, CPU): ``sequence_parallel_size=2`` trains the demo
GPT and a Hugging Face Llama to the parameters of plain single-process PyTorch on the whole sequences, at ZeRO stages
1-3, on 2 ranks (one group) and 4 (two groups, data-parallel 2); bad input fails with errors that name the way out."""

import pytest

from tests.launch import launch
from tests.tolerances import reordered_fp32, reordered_fp32_loss

pytestmark = pytest.mark.slow

ACCUMULATE = 2
#: The cases both the 2-rank and the 4-rank runs train.
STAGES = ["gpt_stage1", "gpt_stage2", "gpt_stage3", "llama_stage1", "llama_stage3"]


@pytest.fixture(scope="module")
def two_ranks():
    return launch("tests.distributed.worker_sequence_parallel", "two_ranks", "errors", nprocs=2)


@pytest.fixture(scope="module")
def four_ranks():
    return launch("tests.distributed.worker_sequence_parallel", "four_ranks", nprocs=4)["four_ranks"]


def _exact(result):
    # the same arithmetic per head and per position; only the projections' row blocking differs (reordered fp32)
    assert result["steps"] == 3
    assert result["param_change"] > 100 * result["param_diff"]  # the runs trained
    assert result["param_diff"] <= reordered_fp32(result["lr"], result["steps"]), result["param_diff"]


@pytest.mark.parametrize(
    "case",
    [
        *STAGES,
        "llama_stage2",
        "llama_everything_stage3",
        "gpt_checkpointed_offloaded_stage3",
        "llama_shift_labels_stage2",
        "gpt2_stage2",
        "llama_own_checkpointing_stage2",
        "gpt_group_mean_stage2",
    ],
)
def test_one_group_trains_as_single_process_on_whole_sequences(two_ranks, case):
    """2 ranks share every sample, each holding 16 of the GPT's 32 positions (6 of the Llama's 12): 3 steps of 2
    accumulated micro-batches, clipped, two param groups and a warmup schedule (GPT), labels with masked positions
    (Llama); also with the Llama's layers checkpointed, offloaded and tiled, and the GPT's blocks checkpointed and
    offloaded (their recomputation exchanges heads again in backward); a batch that also holds the user's shifted
    labels (``shift_labels``); GPT-2 (learned positions, handed its global ``position_ids``); the Llama under its own
    (reentrant) gradient checkpointing; a GPT whose loss ``group_mean`` takes over tokens that count unequally on
    the two ranks. The sampler deals both ranks the same samples."""
    result = two_ranks["two_ranks"][case]
    _exact(result)
    assert result["sampler"] == {"num_replicas": 1, "rank": 0}


@pytest.mark.parametrize(
    "case", ["llama_stage1", "llama_stage2", "llama_stage3", "llama_everything_stage3", "llama_shift_labels_stage2"]
)
def test_the_hugging_face_loss_is_the_groups(two_ranks, case):
    """The loss a step returns (and logs) is the mean over every valid token of the micro-batch, the whole sequence's,
    not the rank's half; and the model is given back with its attention implementation and no hooks after fit."""
    result = two_ranks["two_ranks"][case]
    returned = [loss * ACCUMULATE for loss in result["losses"]]  # Lightning reports the loss over the accumulation
    expected = result["expected_losses"]
    assert len(returned) == len(expected) == 6
    for step, (got, want) in enumerate(zip(returned, expected)):
        assert abs(got - want) <= reordered_fp32_loss(want, step // ACCUMULATE), (step, got, want)
    assert result["attention_after_fit"] == "sdpa"
    assert result["hooks_after_fit"] == 0


@pytest.mark.many_ranks
@pytest.mark.parametrize("case", [*STAGES, "llama_replicated_kv_stage2", "gpt_deepspeed_config"])
def test_two_groups_of_two_train_as_single_process(four_ranks, case):
    """4 ranks: 2 sequence-parallel groups of 2, ZeRO sharding over all 4, each group reading its own samples
    (``distributed_sampler_kwargs`` counts 2 replicas); one group of 4 over the Llama's 2 key/value heads, each
    replicated for the 2 ranks whose query heads read it; and a DeepSpeed config whose ``train_batch_size`` counts the
    data-parallel replicas (2 x 2 accumulated x 2), as DeepSpeed's does."""
    result = four_ranks[case]
    _exact(result)
    replicas = 1 if case == "llama_replicated_kv_stage2" else 2
    assert result["sampler"] == {"num_replicas": replicas, "rank": 0}


@pytest.mark.parametrize(
    "case, words",
    [
        ("arange_positions", ["never asked for its positions", "lightning_zero.sequence_parallel.positions"]),
        ("padding", ["`attention_mask` has zeros", "padded positions would be attended to"]),
        ("packed", ["`position_ids` do not count 0..11", "one sample per row"]),
        ("odd_length", ["11 positions", "multiple of 2"]),
        ("odd_heads", ["3 heads", "divides 3"]),
        ("sliding_window", ["MixtralForCausalLM uses sliding-window attention"]),
        ("no_attention", ["no attention in the module's training_step went through F.scaled_dot_product_attention"]),
        ("reentrant_checkpoint", ["use_reentrant=True", "ZeroStrategy(activation_checkpointing=...)"]),
        ("own_sampler", ["ranks 0 and 1 share each sample but were given different batches"]),
        ("own_token_count", ["was given `num_items_in_batch`", "leave it out"]),
    ],
)
def test_what_sequence_parallelism_cannot_run_is_refused_by_name(two_ranks, case, words):
    """A GPT that builds positions with ``torch.arange(T)``, a padding mask, packed samples, a length or a number of
    heads a group of 2 cannot split, sliding-window attention, a GPT without attention the group can reach, one that
    checkpoints its blocks with torch's reentrant checkpoint, a DataLoader whose own sampler deals the ranks of a group
    different samples, and a token count taken on a rank's part: each fit fails on every rank with an error that names
    the setting and the way out, instead of training on wrong positions, attention or losses."""
    message = two_ranks["errors"][case]
    assert message.startswith("ZeroConfigError: `sequence_parallel_size=2`"), message
    for word in words:
        assert word in message, message


def test_outside_the_steps_a_wired_model_runs_on_one_rank_as_itself(two_ranks):
    """A callback on rank 0 alone runs the Hugging Face model on a whole sequence after a step: the model is plain
    outside the strategy's steps, so it returns every position's logits and nothing waits for the other rank."""
    assert two_ranks["two_ranks"]["rank_zero_forward_stage2"]["shape"] == [1, 12, 64]


@pytest.mark.many_ranks
def test_predict_with_unequal_batches_per_group_ends(four_ranks):
    """Lightning's predict sampler deals 9 samples to 2 replicas as 5 and 4: each group compares its batches within
    itself, so the group with one more batch does not wait for the other; each rank predicts its half of the
    positions."""
    result = four_ranks["predicted_stage2"]
    assert result["batches"] == 5 and result["positions"] == [[1, 16]]


def test_validation_under_sequence_parallelism_logs_the_whole_sequences_loss(two_ranks):
    """``trainer.validate`` after the fit, the batches cut the same way: the logged ``val_loss`` is single-process
    PyTorch's mean loss over the whole sequences with the same weights."""
    result = two_ranks["two_ranks"]["llama_validated_stage2"]
    expected = result["expected_val_loss"]
    assert abs(result["val_loss"] - expected) <= reordered_fp32_loss(expected, 0), result
