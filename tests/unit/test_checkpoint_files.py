"""Checkpoint files without processes: temporaries and their cleanup, listing, manifest checks, save errors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings

import pytest
import torch

from lightning_zero import ZeroConfigError, ZeroStrategy, list_checkpoints
from lightning_zero.checkpoint.errors import CheckpointSaveError, on_every_rank, save_error, with_errno
from lightning_zero.checkpoint.files import (
    clean_directory,
    parse_temporary,
    remove_temporaries,
    replace,
    temporary_path,
)
from lightning_zero.checkpoint.listing import inspect_checkpoint
from lightning_zero.checkpoint.verify import CheckpointError, read_manifest, verify_files
from lightning_zero.checkpoint.write import save_full, save_sharded


@pytest.fixture
def sharded(tmp_path):
    def save(name: str, step: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
            save_sharded({"state_dict": {"w": torch.full((4, 3), float(step))}, "global_step": step}, tmp_path / name)
        return tmp_path / name

    return save


def test_temporary_names_are_recognised_with_their_final_name(tmp_path):
    tmp = temporary_path(tmp_path / "epoch=3-step=[40].ckpt")
    assert parse_temporary(tmp.name) == ("epoch=3-step=[40].ckpt", "tmp")
    assert parse_temporary(".last.ckpt.old-0123abcd") == ("last.ckpt", "old")
    for name in ("last.ckpt", ".last.ckpt.tmp", ".last.ckpt.tmp-XYZ12345", ".hidden"):
        assert parse_temporary(name) is None


def test_cleanup_removes_temporaries_and_puts_back_a_checkpoint_moved_aside(tmp_path, sharded):
    keep = sharded("keep.ckpt", 1)
    shutil.copytree(keep, tmp_path / ".keep.ckpt.tmp-0000aaaa")  # a dead writer of keep.ckpt
    shutil.copytree(keep, tmp_path / ".keep.ckpt.old-0000bbbb")  # a stale copy: keep.ckpt exists
    moved = sharded("moved.ckpt", 2)
    os.replace(moved, tmp_path / ".moved.ckpt.old-0000cccc")  # killed between the two renames
    (tmp_path / ".moved.ckpt.tmp-0000dddd").mkdir()
    (tmp_path / ".notes").write_text("someone else's")
    (tmp_path / "[weird]").mkdir()  # glob metacharacters in names must not confuse anything
    removed = clean_directory(tmp_path)
    assert sorted(p.name for p in removed) == [
        ".keep.ckpt.old-0000bbbb",
        ".keep.ckpt.tmp-0000aaaa",
        ".moved.ckpt.tmp-0000dddd",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes", "[weird]", "keep.ckpt", "moved.ckpt"]
    assert inspect_checkpoint(tmp_path / "moved.ckpt", verify=True).global_step == 2
    assert remove_temporaries(tmp_path / "keep.ckpt") == []


def test_replace_swaps_directories_and_files_either_way(tmp_path):
    final = tmp_path / "ckpt"
    for make in (lambda p: p.mkdir(), lambda p: p.write_text("file"), lambda p: p.mkdir()):
        new = temporary_path(final)
        make(new)
        replace(new, final)
        assert final.exists() and not new.exists()
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no .old- left behind


def test_listing_newest_first_with_status_and_step(tmp_path, sharded):
    old = sharded("a.ckpt", 1)
    new = sharded("b.ckpt", 2)
    os.utime(old / "manifest.json", (1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_full({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "full.ckpt")
    shutil.copytree(new, tmp_path / "broken.ckpt")
    (tmp_path / "broken.ckpt" / "meta.pt").unlink()
    shutil.copytree(new, tmp_path / ".c.ckpt.tmp-0123abcd")
    (tmp_path / "model.pt").write_bytes(b"a consolidated file: not listed")
    entries = list_checkpoints(tmp_path)
    by_name = {e.path.name: e for e in entries}
    assert entries[-1].path.name == "a.ckpt"  # oldest last
    summary = lambda name: (by_name[name].status, by_name[name].global_step, by_name[name].kind)  # noqa: E731
    assert summary("a.ckpt") == ("complete", 1, "sharded") and summary("full.ckpt") == ("complete", 3, "full")
    assert by_name["broken.ckpt"].status == "corrupted" and "meta.pt" in by_name["broken.ckpt"].problem
    assert by_name[".c.ckpt.tmp-0123abcd"].status == "incomplete"
    assert "model.pt" not in by_name and list_checkpoints(tmp_path / "missing") == []


def test_recursive_listing_finds_checkpoints_below_without_entering_a_sharded_one(tmp_path, sharded):
    """`lightning-zero verify runs/gpt_zero3` must find runs/gpt_zero3/checkpoints/last.ckpt (issue 36, item 4)."""
    run = tmp_path / "run"
    (run / "logs" / "version_0").mkdir(parents=True)
    (run / "logs" / "version_0" / "metrics.csv").write_text("step\n")
    (run / ".hidden").mkdir()
    (run / "checkpoints").mkdir()
    last = sharded("run/checkpoints/last.ckpt", 7)
    nested = sharded("run/logs/version_0/checkpoints/epoch=0-step=3.ckpt", 3)
    shutil.copytree(last, run / ".hidden" / "skipped.ckpt")
    (run / "loop").symlink_to(run, target_is_directory=True)  # no cycle
    assert list_checkpoints(run) == []  # not recursive: the behaviour auto-resume relies on
    found = list_checkpoints(run, recursive=True)
    assert sorted(e.path for e in found) == sorted([last, nested])
    assert {e.path.name: e.global_step for e in found} == {"last.ckpt": 7, "epoch=0-step=3.ckpt": 3}
    # a sharded checkpoint is one entry: its DCP files are not listed, its folder is not searched
    assert list_checkpoints(last, recursive=True) == []


def test_verify_command_searches_below_the_folder_it_is_given(tmp_path, sharded, capsys):
    from lightning_zero.cli.verify import main as verify

    sharded("run/checkpoints/last.ckpt", 150)
    assert verify([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["complete", "sharded", "150", str(tmp_path / "run" / "checkpoints" / "last.ckpt")]
    assert out[-1] == "1 checkpoint: 1 complete"
    (tmp_path / "empty" / "logs").mkdir(parents=True)
    assert verify([str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().out.strip() == f"no checkpoints found in {tmp_path / 'empty'} or below"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(format="lightning_zero.sharded/9"), "this version of lightning_zero reads"),
        (lambda m: m["files"].update({"../escape": {"bytes": 1, "crc32": 1}}), "not a file name in the checkpoint"),
        (lambda m: m["files"].pop("meta.pt"), "does not list meta.pt"),
        (lambda m: m["files"][".metadata"].update(bytes=-1), "not a size and a CRC-32"),
        (lambda m: m["files"].pop("__0_0.distcp"), "__0_0.distcp is not listed in"),
    ],
)
def test_a_damaged_manifest_names_itself(sharded, edit, message):
    path = sharded("m.ckpt", 1)
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json") as err:
        read_manifest(path)
        verify_files(path)
    assert message in str(err.value)


def test_disk_full_errors_keep_their_errno_and_say_what_is_kept(tmp_path):
    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    try:
        try:
            raise cause
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from inner
    except RuntimeError as err:
        described = with_errno(err, "a shard file in /ckpt/.x.tmp-1")
    assert (described.errno, described.filename) == (errno.ENOSPC, "a shard file in /ckpt/.x.tmp-1")
    message = str(save_error(tmp_path / "x", {1: described}, previous=True))
    assert "failed on rank 1." in message and "[Errno 28] No space left on device" in message
    assert "The disk may be full" in message and f"the previous checkpoint at {tmp_path / 'x'} is intact" in message
    other = str(save_error(tmp_path / "y", {0: "AttributeError: Can't pickle"}, previous=False))
    assert "disk may be full" not in other and "nothing was written under" in other


def test_one_rank_failures_become_every_ranks_error():
    assert on_every_rank(lambda: 5, lambda f: CheckpointSaveError(str(f))) == [5]
    with pytest.raises(CheckpointSaveError, match="rank 0"):
        on_every_rank(lambda: 1 / 0, lambda f: save_error(__import__("pathlib").Path("p"), f, False))


def test_async_save_needs_sharded_checkpoints():
    ZeroStrategy(async_save=True)
    with pytest.raises(ZeroConfigError, match="async_save=True.*state_dict_type='full'"):
        ZeroStrategy(async_save=True, state_dict_type="full")
    with pytest.raises(ZeroConfigError, match="`async_save` must be True or False"):
        ZeroStrategy(async_save="yes")


@pytest.mark.alone  # a bound on wall time
def test_waiting_for_a_stuck_async_save_is_bounded_by_the_timeout(tmp_path):
    """A save whose background writer never finishes and whose files do not grow: the wait gives up after
    `timeout`, says what it waited for, and the save is abandoned (not renamed into place should it finish)."""
    import concurrent.futures
    import time
    from datetime import timedelta

    from lightning_zero.checkpoint.async_save import AsyncSaver, _Pending

    saver = AsyncSaver(group=None, timeout=timedelta(seconds=0.3))  # one wait slice (1 s) at least
    pending = _Pending(tmp_path / "last.ckpt", tmp_path / ".last.ckpt.tmp-0123abcd", previous=True, step=40)
    pending.done = concurrent.futures.Future()  # a writer stuck on a dead peer
    saver._pending = pending
    start = time.monotonic()
    with pytest.raises(CheckpointSaveError) as err:
        saver.wait()
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert "last.ckpt (step 40) made no progress for timeout=0.3s while rank 0 waited" in message
    assert "the previous checkpoint at" in message and "is intact" in message
    assert pending.abandoned and saver.pending is None
