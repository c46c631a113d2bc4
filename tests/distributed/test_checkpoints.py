"""Sharded and full checkpoints: exact resume, resharding, atomic saves, integrity and compatibility checks,
consolidation. Two launches share one directory: 2 ranks write, 1 rank reads."""

import json
import shutil

import pytest
import torch

from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.verify import CheckpointError, check_complete, verify_files
from lightning_zero.cli import main as cli_main
from tests.distributed import models
from tests.launch import launch
from tests.tolerances import assert_reordered_fp32, assert_reordered_fp32_moments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    env = {"LZ_SHARED_DIR": str(directory)}
    two = launch(
        "tests.distributed.worker_checkpoint",
        "exact_resume",
        "save_for_other_world",
        "crash_mid_save",
        "mismatched_model",
        "edited_and_lenient",
        "top_k",
        "frozen_and_weights_only",
        "stateless_at_save",
        "saved_after_evaluation",
        "scheduled_accumulation",
        "continued_after_fit",
        nprocs=2,
        env=env,
    )
    one = launch("tests.distributed.worker_checkpoint", "resume_in_other_world", "corrupted", nprocs=1, env=env)
    return {**two, **one, "dir": directory}


def _check_resume(result, pair):
    assert result["steps"] == 6
    save, resume = pair.split("->")
    if save == resume:  # the same stage's arithmetic before and after the resume, in the same processes
        assert result["param_diff"] == 0.0 and result["optim_diff"] == 0.0
    else:  # the first epoch ran at another stage (another reduction, or gathered weights in other memory)
        assert_reordered_fp32(pair, result["param_diff"], result["lr"], result["steps"])
        assert_reordered_fp32_moments(pair, result["optim_diff"], result["steps"], result["moment_scale"])


@pytest.mark.parametrize("pair", ["2->2", "3->3", "2->3", "2->1"])
def test_interrupted_run_equals_uninterrupted(shared, pair):
    """1 epoch, ModelCheckpoint, new Trainer resumes (at the same or another stage) for epoch 2."""
    _check_resume(shared["exact_resume"][pair], pair)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_mid_epoch_resume_keeps_the_epochs_scheduled_accumulation(shared, stage):
    """``GradientAccumulationScheduler`` sets the accumulation in ``on_train_epoch_start``, which Lightning does not
    run for the epoch it resumes mid-way (``ddp`` then trains the rest of it with the Trainer's 1): the resumed run
    accumulates 3 as the uninterrupted one, and ends with its parameters."""
    result = shared["scheduled_accumulation"][f"stage{stage}"]
    assert result["steps"] == 10 and result["accumulate"] == 3
    assert result["param_diff"] == 0.0


@pytest.fixture(scope="module")
def other_pairs(tmp_path_factory):
    env = {"LZ_SHARED_DIR": str(tmp_path_factory.mktemp("ckpt_full"))}
    return launch("tests.distributed.worker_checkpoint", "exact_resume_full", nprocs=2, env=env)["exact_resume_full"]


@pytest.mark.full
@pytest.mark.parametrize("pair", ["1->1", "3->2"])
def test_interrupted_run_equals_uninterrupted_at_the_other_pairs(other_pairs, pair):
    _check_resume(other_pairs[pair], pair)


@pytest.mark.parametrize("run", ["stage1_full", "stage2_bf16_offload", "stage3"])
def test_a_checkpoint_saved_after_evaluating_is_the_one_saved_after_fit(shared, run):
    """fit, save, then validate, test and predict, save again: the same tensors, optimizer state included (stage 3
    raised, stages 1-2 wrote none: the fit's optimizer state is keyed by the fit's shards)."""
    result = shared["saved_after_evaluation"][run]
    assert result["names"] and result["optimizer_tensors"] > 0
    assert result["max_diff"] == 0.0


@pytest.mark.parametrize("stopped", [2, 3], ids=["mid_epoch", "at_epoch_end"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_run_continued_from_a_save_after_fit_trains_as_ddp_does_without_a_warning(shared, stage, stopped):
    """``fit`` to ``max_steps``, ``trainer.save_checkpoint``, a new Trainer continues to a later ``max_steps``: Lightning
    counts the stopped epoch as done and numbers the next batches from its own counters; the data is what ``ddp``
    trains on, and nothing tells the user to report a mismatch."""
    result = shared["continued_after_fit"]
    assert result[f"zero{stage} {stopped} steps"] == result[f"ddp {stopped} steps"] == 5
    assert result[f"zero{stage} {stopped} skipped"] == []
    assert_reordered_fp32(
        f"zero{stage} stopped at {stopped}",
        result[f"zero{stage} {stopped} diff"],
        result[f"zero{stage} {stopped} lr"],
        result[f"zero{stage} {stopped} steps"],
    )


def test_a_checkpoint_after_evaluating_loaded_weights_is_refused_but_for_the_weights(shared):
    message = shared["saved_after_evaluation"]["after_loading"]
    assert message is not None and "weights_only=True" in message and "trainer.validate" in message


@pytest.mark.parametrize("name", ["sharded", "full.ckpt"])
def test_two_rank_checkpoint_resumes_in_one_process(shared, name):
    result = shared["resume_in_other_world"]
    assert result["world"] == 1
    assert result[name]["param_diff"] == 0.0
    assert result[name]["optim_diff"] == 0.0
    assert result[name]["steps"] == 5


def test_a_save_that_fails_mid_way_leaves_the_previous_checkpoint(shared):
    result = shared["crash_mid_save"]
    assert result["error"] == "CheckpointSaveError"  # a RuntimeError, raised on every rank
    assert "new" not in result["entries"]
    assert not [e for e in result["entries"] if e.startswith(".")]  # no temporary directories left
    assert result["good_diff"] == 0.0


def test_checkpoint_of_another_model_lists_every_difference(shared):
    result = shared["mismatched_model"]
    assert result["error"] == "CheckpointError"
    message = result["message"]
    assert "missing (2): net.extra.bias, net.extra.weight" in message
    assert "net.head.weight: checkpoint (3, 7) vs (5, 7)" in message


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_on_save_checkpoint_edits_are_saved_and_a_lenient_module_resumes_without_the_dropped_keys(shared, kind):
    """As under ``ddp``: an entry added in ``on_save_checkpoint`` comes back in ``on_load_checkpoint``, keys dropped
    from its ``state_dict`` are not written, and a module with ``strict_loading = False`` resumes without them; a
    sharded directory's ``state_dict`` reaches ``on_load_checkpoint`` empty (each rank reads its rows itself)."""
    result = shared["edited_and_lenient"][kind]
    body = [
        f"net.{layer}.{kind}"
        for layer in ("blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "inp", "norm")
        for kind in ("bias", "weight")
    ]
    assert result["saved"] == body  # the head dropped
    assert result["loaded"]["vocabulary"] == {"a": 0, "b": 1}
    assert result["loaded"]["keys"] == ([] if kind == "sharded" else sorted(result["saved"]))
    assert result["steps"] == 2


@pytest.mark.parametrize("pair", ["2->2", "3->1", "1->3"])
def test_a_layer_without_optimizer_state_at_the_save_resumes_as_the_uninterrupted_run(shared, pair):
    """AdamW has no state for a parameter that never had a gradient; the sharded load refused such a checkpoint
    ("does not match the optimizer 0's parameters: missing (2): late.bias, late.weight"), and priming the state with a
    zero step would have started the layer's step count at 1 (the third pair offloads the optimizer)."""
    result = shared["stateless_at_save"][pair]
    assert result["steps"] == 4
    assert result["param_diff"] == 0.0


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_in_the_optimizer_and_weights_only_checkpoints(shared, stage):
    result = shared["frozen_and_weights_only"][f"stage{stage}"]
    assert result["resumed_steps"] == 3
    assert result["param_diff"] == 0.0  # frozen layer has no optimizer state, and resuming does not miss it
    assert "contains only the model" in result["weights_only_error"]  # nothing silently left un-restored


def test_truncated_shard_is_named(shared):
    result = shared["corrupted"]
    assert result["error"] == "CheckpointError"
    assert ".distcp" in result["message"] and "truncated" in result["message"]


def test_model_checkpoint_top_k_and_last_with_directories(shared):
    result = shared["top_k"]
    assert result["entries"] == ["epoch=1-step=4.ckpt", "epoch=1-step=5.ckpt", "last.ckpt"]
    assert result["best"] == "epoch=1-step=4.ckpt"


def test_consolidated_file_is_a_plain_state_dict(shared, tmp_path):
    expected = torch.load(shared["dir"] / "expected.pt", weights_only=True)
    out = consolidate(shared["dir"] / "sharded", tmp_path / "model.pt", include_optimizer=True)
    loaded = torch.load(out, weights_only=True)
    model = models.Regression()
    model.load_state_dict(loaded["state_dict"])
    for name, value in expected["params"].items():
        assert torch.equal(loaded["state_dict"][name], value), name
    optimizer, _ = models.make_optimizer(model)
    optimizer.load_state_dict(loaded["optimizer_states"][0])  # torch.optim format, integer keys
    for index, entry in expected["optim"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded["optimizer_states"][0]["state"][index][key], value)


def test_consolidate_command_line(shared, tmp_path, capsys):
    dst = tmp_path / "plain.pt"
    assert cli_main(["consolidate", str(shared["dir"] / "sharded"), str(dst)]) == 0
    state = torch.load(dst, weights_only=True)
    models.Regression().load_state_dict(state)
    # A weights-only checkpoint has no optimizer state for --optimizer to write: refused, not an empty list.
    capsys.readouterr()
    assert cli_main(["consolidate", str(shared["dir"] / "weights2"), str(tmp_path / "opt.pt"), "--optimizer"]) == 2
    assert "holds no optimizer state" in capsys.readouterr().err and not (tmp_path / "opt.pt").exists()


def test_integrity_and_completeness_checks(shared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shared["dir"] / "sharded", copy)
    verify_files(copy)
    shard = sorted(copy.glob("__*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupted"):
        verify_files(copy)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        check_complete(tmp_path)
    (tmp_path / ".later.tmp-0a1b2c3d").mkdir()
    with pytest.raises(CheckpointError, match="still being written"):
        check_complete(tmp_path / "later")
    with pytest.raises(FileNotFoundError):
        check_complete(tmp_path / "nowhere")
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["format"].startswith("lightning_zero.sharded")
