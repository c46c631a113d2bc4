"""Resume logic that needs no processes: where a checkpoint resumes in the data, the DataLoader that continues
there, which checkpoint auto-resume picks. The multi-process kill tests are tests/integration/test_auto_resume.py."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from lightning_zero.resume import (
    DataPosition,
    checkpoint_directories,
    position_from_loops,
    restart_count,
    resume_candidates,
)
from lightning_zero.resume.agreement import JOB_KEY, job_identity, same_job
from lightning_zero.resume.ckpt_path import decide
from lightning_zero.resume.newest_checkpoint import resolve_last
from lightning_zero.resume.sampler import ResumeBatchSampler, ResumeSampler, resume_dataloader


def loops(epoch: dict, batch: dict, is_last_batch: bool = False) -> dict:
    """The parts of ``checkpoint["loops"]`` a position is read from (as lightning 2.6 saves them)."""
    return {
        "fit_loop": {
            "epoch_progress": {"current": epoch, "total": epoch},
            "epoch_loop.batch_progress": {"current": batch, "total": batch, "is_last_batch": is_last_batch},
        }
    }


def counts(ready, started, processed, completed) -> dict:
    return dict(ready=ready, started=started, processed=processed, completed=completed)


# Loop states measured from real checkpoints (lightning 2.6.6; 5 batches per epoch), and where Lightning resumed.
@pytest.mark.parametrize(
    "state, expected",
    [
        (loops(counts(1, 1, 0, 0), counts(2, 2, 2, 1)), DataPosition(0, 2)),  # on_train_batch_end of batch 1
        (loops(counts(2, 2, 1, 1), counts(2, 2, 2, 1)), DataPosition(1, 2)),  # the same, epoch 1
        (
            loops(counts(1, 1, 0, 0), counts(5, 5, 5, 4), True),
            DataPosition(1, 0),
        ),  # on_train_batch_end of the last batch
        (loops(counts(1, 1, 1, 0), counts(5, 5, 5, 5), True), DataPosition(1, 0)),  # on_train_epoch_end
        (loops(counts(1, 1, 0, 0), counts(3, 3, 3, 3)), DataPosition(0, 3)),  # between batches (SIGTERM checkpoint)
        (loops(counts(1, 1, 0, 0), counts(5, 5, 5, 5), True), DataPosition(1, 0)),  # between batches, after the last
        (loops(counts(1, 1, 0, 0), counts(3, 3, 2, 2)), DataPosition(0, 2)),  # inside training_step of batch 2: again
        # After ``fit`` returned, mid-epoch and after the epoch's last batch: Lightning numbers the next batches from its
        # counters, the data starts again, nothing was trained on, nothing is skipped (as under ``ddp``).
        (loops(counts(1, 1, 1, 1), counts(3, 3, 3, 3)), DataPosition(1, 0, after_fit=True)),
        (loops(counts(1, 1, 1, 1), counts(5, 5, 5, 5), True), DataPosition(1, 0, after_fit=True)),
        (loops(counts(0, 0, 0, 0), counts(0, 0, 0, 0)), DataPosition(0, 0)),  # before the first epoch began
    ],
)
def test_position_mirrors_lightnings_restart(state, expected):
    assert position_from_loops(state) == expected


def test_no_position_without_a_fit_loop():
    assert position_from_loops(None) is None
    assert position_from_loops({"validate_loop": {}}) is None


def test_resume_sampler_skips_once_in_the_resumed_epoch_only():
    inner = DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler = ResumeSampler(inner, skip=4, epoch=2)
    inner.set_epoch(2)
    full_epoch_2 = list(inner)
    assert inner.epoch == 2 and len(sampler) == len(inner) == 10  # the epoch is set before any iterator exists
    assert list(sampler) == full_epoch_2[4:]
    assert list(sampler) == full_epoch_2  # a second iterator of the same epoch (e.g. a reload) is whole
    sampler.set_epoch(3)
    inner.set_epoch(3)
    assert list(sampler) == list(inner)


def test_resumed_dataloader_continues_with_the_same_batches():
    data = list(range(30))
    loader = DataLoader(
        data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=5), drop_last=True
    )
    loader.sampler.set_epoch(1)
    uninterrupted = [b.tolist() for b in loader]
    seen = []
    resumed = resume_dataloader(loader, DataPosition(epoch=1, batches_done=3), on_iterator=seen.append)
    assert resumed is not loader and len(resumed) == len(loader) == 7 and resumed.batch_size == 4
    assert [b.tolist() for b in resumed] == uninterrupted[3:]
    assert len(seen) == 1 and seen[0].loads_in_process and seen[0].uses_global_rng


def test_a_custom_batch_sampler_is_skipped_by_whole_batches():
    class Pairs(BatchSampler):  # groups indices its own way: a sampler-level skip would regroup them
        def __iter__(self):
            ids = list(self.sampler)
            return iter([ids[i : i + 2] + ids[-1 - i :][:1] for i in range(0, len(ids) // 2, 2)])

    data = list(range(12))
    loader = DataLoader(data, batch_sampler=Pairs(SequentialSampler(data), batch_size=3, drop_last=False))
    uninterrupted = [b.tolist() for b in loader]
    resumed = resume_dataloader(loader, DataPosition(epoch=0, batches_done=2))
    assert isinstance(resumed.batch_sampler, ResumeBatchSampler)
    assert [b.tolist() for b in resumed] == uninterrupted[2:]


def test_an_iterable_dataset_is_left_alone_with_a_warning():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    loader = DataLoader(Stream(), batch_size=2)
    with pytest.warns(UserWarning, match="IterableDataset"):
        assert resume_dataloader(loader, DataPosition(epoch=0, batches_done=2)) is loader


def test_restart_count_reads_torchrun_and_slurm(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert restart_count() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count() == 2
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert restart_count() == 3


def test_a_checkpoint_of_this_launcher_job_is_recognised(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert job_identity() == {"torchelastic_run_id": "job-42"}
    assert same_job({"torchelastic_run_id": "job-42"}) and not same_job({"torchelastic_run_id": "job-41"})
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id identifies nothing
    assert job_identity() == {} and not same_job({"torchelastic_run_id": "none"})


def _full_checkpoint(path: Path, step: int, mtime: float) -> None:
    torch.save({"global_step": step, "state_dict": {"w": torch.ones(2)}}, path)
    os.utime(path, (mtime, mtime))


def test_auto_resume_picks_the_newest_complete_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _full_checkpoint(ckpt / "epoch=0-step=3.ckpt", 3, 1000)
    _full_checkpoint(ckpt / "epoch=0-step=6.ckpt", 6, 2000)
    _full_checkpoint(ckpt / "broken.ckpt", 9, 4000)
    (ckpt / "broken.ckpt").write_bytes((ckpt / "broken.ckpt").read_bytes()[:50])  # truncated: corrupted
    (ckpt / ".epoch=0-step=9.ckpt.tmp-0123abcd").mkdir()  # a save that died: incomplete
    trainer = L.Trainer(callbacks=[ModelCheckpoint(dirpath=ckpt)], logger=False, default_root_dir=tmp_path)
    assert checkpoint_directories(trainer) == [ckpt.resolve()]
    picked = resume_candidates(trainer)
    assert [e.path.name for e in picked] == ["epoch=0-step=6.ckpt", "epoch=0-step=3.ckpt"]
    assert picked[0].global_step == 6


def test_without_dirpath_every_logger_version_is_searched(tmp_path):
    for version in ("version_0", "version_1"):
        (tmp_path / "lightning_logs" / version / "checkpoints").mkdir(parents=True)
    _full_checkpoint(tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt", 4, 1000)
    trainer = L.Trainer(default_root_dir=tmp_path, enable_progress_bar=False)
    assert [p.parent.name for p in checkpoint_directories(trainer)] == ["version_0", "version_1"]
    assert resume_candidates(trainer)[0].global_step == 4


def test_last_skips_a_damaged_last_checkpoint(tmp_path):
    _full_checkpoint(tmp_path / "last.ckpt", 5, 2000)
    _full_checkpoint(tmp_path / "last-v1.ckpt", 8, 3000)
    (tmp_path / "last-v1.ckpt").write_bytes(b"not a checkpoint")
    trainer = L.Trainer(
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], logger=False, default_root_dir=tmp_path
    )
    with pytest.warns(UserWarning, match="last-v1.ckpt"):
        assert resolve_last(trainer) == str(tmp_path.resolve() / "last.ckpt")


def test_a_node_whose_restart_was_not_counted_resumes_too(tmp_path, monkeypatch):
    """torchrun restarts a node's live workers with an unchanged restart count; the checkpoint names the job."""
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    torch.save({"global_step": 3, JOB_KEY: {"torchelastic_run_id": "job-7"}}, tmp_path / "a.ckpt")
    trainer = L.Trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path)], logger=False, default_root_dir=tmp_path)
    assert decide(trainer).path == str(tmp_path.resolve() / "a.ckpt")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")  # another job's checkpoint, first attempt: start fresh
    assert decide(trainer).path is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart resumes whoever wrote it
    assert decide(trainer).path == str(tmp_path.resolve() / "a.ckpt")
