"""Checkpoints survive faults: a full disk on one rank, asynchronous saves (exact, ordered removals, a
failure in the background), leftovers of interrupted saves, damaged checkpoints given to ``fit``, and
``lightning-zero verify`` over what those runs leave. One launch of 2 ranks for ``make test``; the whole
matrix under ``full``."""

from __future__ import annotations

import json
import shutil

import pytest

from lightning_zero.cli import main as cli_main
from tests.launch import launch

pytestmark = pytest.mark.slow

GROUPS = ("disk_full", "async_exact", "async_top_k", "async_failure", "temporaries", "damaged_resumes")


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    directory = tmp_path_factory.mktemp("faults")
    report = launch(
        "tests.distributed.worker_checkpoint_faults",
        *GROUPS,
        nprocs=2,
        timeout=300,
        env={"LZ_SHARED_DIR": str(directory)},
    )
    return {**report, "dir": directory}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    directory = tmp_path_factory.mktemp("faults-matrix")
    return launch(
        "tests.distributed.worker_checkpoint_faults",
        "disk_full_matrix",
        "async_exact_matrix",
        nprocs=2,
        timeout=300,
        env={"LZ_SHARED_DIR": str(directory)},
    )


def check_disk_full(result: dict, failing_rank: int) -> None:
    """Every rank raised the same clear error; the save left nothing; step 2's checkpoint loads and verifies."""
    assert result["steps_run"] == 3  # the save after step 3 failed and ended fit, on every rank
    for error in result["errors"]:
        assert error["type"] == "CheckpointSaveError", error
        message = error["message"]
        assert f"failed on rank {failing_rank}." in message
        assert "ckpt.ckpt" in message and "[Errno 27] File too large" in message
        assert "The disk may be full" in message
        assert "the previous checkpoint at" in message and "is intact" in message
    assert result["errors"][0] == result["errors"][1]
    assert result["leftovers"] == []  # no .ckpt.ckpt.tmp-* (nor .old-*)
    assert result["status"] == "complete" and result["saved_step"] == 2
    assert result["restored_diff"] == 0.0 and result["resumed_steps"] == 3


@pytest.mark.parametrize(("case", "rank"), [("sharded_r1", 1), ("full_r0", 0)])
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(faults, case, rank):
    check_disk_full(faults["disk_full"][case], rank)


@pytest.mark.full
@pytest.mark.parametrize(("case", "rank"), [("sharded_r0", 0), ("sharded_r1_s3", 1), ("full_r0_s3", 0)])
def test_a_full_disk_matrix(matrix, case, rank):
    check_disk_full(matrix["disk_full_matrix"][case], rank)


def check_async_exact(result: dict) -> None:
    assert set(result["checkpoint_diff"].values()) == {0.0}  # the same bytes' worth as a sync save, every epoch
    assert result["training_diff"] == 0.0  # saving in the background does not disturb training
    assert result["resumed_diff"] == 0.0  # and its checkpoint resumes to the uninterrupted run's end
    assert result["entries"] == [
        f"{name}:complete" for name in ("epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt")
    ]


def test_async_saves_write_what_sync_saves_write_and_resume_exactly(faults):
    check_async_exact(faults["async_exact"]["stage2"])


@pytest.mark.full
@pytest.mark.parametrize("stage", [1, 3])
def test_async_saves_at_other_stages(matrix, stage):
    check_async_exact(matrix["async_exact_matrix"][f"stage{stage}"])


def test_top_k_removals_wait_for_the_async_save_that_replaces_them(faults):
    result = faults["async_top_k"]
    assert result["async"]["entries"] == result["sync"]["entries"]
    assert result["async"]["best"] == result["sync"]["best"]
    assert result["async"]["min_complete"] >= 1  # never a moment without a complete checkpoint


def test_a_failed_async_save_raises_on_every_rank_at_the_next_save(faults):
    result = faults["async_failure"]
    assert result["steps_run"] == 3  # failed at step 2's save, raised when step 3's save waited for it
    assert result["errors"][0] == result["errors"][1]
    message = result["errors"][0]["message"]
    assert result["errors"][0]["type"] == "CheckpointSaveError"
    assert "failed on rank 1." in message and "File too large" in message and "is intact" in message
    assert result["leftovers"] == []
    assert result["status"] == "complete" and result["saved_step"] == 1 and result["intact_diff"] == 0.0


def test_a_run_start_and_the_next_save_remove_only_temporaries(faults):
    result = faults["temporaries"]
    # removed: the dead writers' .tmp- entries and the stale .old- copy; moved back: the orphaned .old-
    assert result["at_start"] == [".hidden", "keep.ckpt", "moved.ckpt"]
    assert result["moved_back"] == "complete"
    assert result["elsewhere"] == ["ckpt"]  # the next save of that path removed its temporary


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("manifest_truncated", "manifest.json is damaged"),
        ("metadata_flipped", ".metadata is corrupted"),
        ("rank1_shard_flipped", "__1_0.distcp is corrupted"),
        ("full_truncated", "damaged-full_truncated is damaged or truncated"),
        ("full_flipped", "damaged-full_flipped is corrupted"),
    ],
)
def test_a_damaged_checkpoint_given_to_fit_fails_on_every_rank_naming_the_file(faults, case, named):
    errors = faults["damaged_resumes"][case]
    assert len(errors) == 2 and errors[0] == errors[1]
    assert errors[0]["type"] == "CheckpointError"
    assert named in errors[0]["message"], errors[0]["message"]


def test_verify_lists_complete_corrupted_and_incomplete_checkpoints(faults, tmp_path, capsys):
    source = faults["dir"]
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(source / "good", runs / "a.ckpt")
    shutil.copytree(source / "damaged-rank1_shard_flipped", runs / "b.ckpt")
    shutil.copy(source / "good.ckpt", runs / "full.ckpt")
    shutil.copytree(source / "good", runs / ".c.ckpt.tmp-0123abcd")
    (runs / "notes.txt").write_text("not a checkpoint")

    assert cli_main(["verify", str(runs)]) == 1
    out = capsys.readouterr().out
    statuses = ("complete", "corrupted", "incomplete")
    lines = {line.split()[-1]: line.split()[:3] for line in out.splitlines() if line.startswith(statuses)}
    assert lines[str(runs / "a.ckpt")] == ["complete", "sharded", "2"]
    assert lines[str(runs / "full.ckpt")] == ["complete", "full", "2"]
    assert lines[str(runs / "b.ckpt")] == ["corrupted", "sharded", "-"]
    assert lines[str(runs / ".c.ckpt.tmp-0123abcd")] == ["incomplete", "sharded", "-"]
    assert "__1_0.distcp is corrupted" in out and "a save of c.ckpt that did not finish" in out
    assert "4 checkpoints: 2 complete, 1 incomplete, 1 corrupted" in out and "notes.txt" not in out

    assert cli_main(["verify", "--quick", "--json", str(runs / "b.ckpt")]) == 0  # sizes only: a flip goes unseen
    assert json.loads(capsys.readouterr().out)["status"] == "complete"
    assert cli_main(["verify", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert cli_main(["verify", str(runs / "a.ckpt")]) == 0
    assert "1 checkpoint: 1 complete" in capsys.readouterr().out
