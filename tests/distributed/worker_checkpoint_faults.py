"""Rank program for checkpoint faults: a full disk, asynchronous saves, leftovers of interrupted saves,
damaged checkpoints given to ``fit`` (pattern: worker_core). Every case gathers what each rank saw, so the
tests can assert that every rank raised, and with which message."""

from __future__ import annotations

import resource
import shutil
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.listing import inspect_checkpoint, list_checkpoints
from lightning_zero.engine.comm import collectives
from tests.distributed import models
from tests.distributed.worker_checkpoint import RestoredProbe, final_state, optim_diff
from tests.distributed.worker_core import RANK, max_diff, trainer
from tests.launch import run_cases_with_directory

COMMON = dict(accumulate_grad_batches=1, gradient_clip_val=0.5)
DATA = models.IndexedData(n=64)  # 8 optimizer steps per epoch on 2 ranks with batches of 4
SHORT_EPOCHS = models.IndexedData(n=16)  # 2 steps per epoch: checkpoints at epoch ends resume exactly


class Wide(models.Regression):
    """Shards of ~30 KiB per rank: larger than ``meta.pt``, so a small file-size limit fails the shard write."""

    def __init__(self) -> None:
        super().__init__()
        self.net = models.Net(width=256)


def loader(data=DATA):
    return models.loader(data, 4)


# ---------------------------------------------------------------------- a file-size limit on one rank
class FileSizeLimit(L.Callback):
    """From optimizer step ``at_step`` on, rank ``rank`` cannot write a file over ``limit`` bytes: its writes
    fail with EFBIG, as on a full disk (SIGXFSZ ignored, so the write returns the error instead)."""

    def __init__(self, rank: int, at_step: int, limit: int = 16 * 1024) -> None:
        self.rank, self.at_step, self.limit = rank, at_step, limit

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            trainer.strategy.wait_for_checkpoint()  # the limit is per process: spare a save in flight
        if RANK == self.rank and trainer.global_step == self.at_step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.RLIM_INFINITY))


def lift_file_size_limit() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


class StateAt(L.Callback):
    """The full parameters after each optimizer step (collective), to compare with what a checkpoint holds."""

    def __init__(self) -> None:
        self.params: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params[trainer.global_step] = trainer.strategy.full_state_dict()


def every_rank(value):
    return collectives.all_gather_objects(value)


def error_of(run) -> dict:
    """Run ``run()``; what this rank raised (type and message), or None."""
    try:
        run()
    except Exception as err:  # the behaviour under test: what every rank reports
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": ""}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def disk_full(directory: Path, state_dict_type: str, failing_rank: int, stage: int = 2) -> dict:
    """ModelCheckpoint overwrites ``ckpt.ckpt`` after every step; from step 3 on one rank cannot write: the
    save fails on every rank, fit raises everywhere, ``ckpt.ckpt`` is still step 2's and resumes."""
    out_dir = directory / f"full-disk-{state_dict_type}-r{failing_rank}-s{stage}"
    L.seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=out_dir, filename="ckpt", every_n_train_steps=1, save_top_k=1)
    state = StateAt()
    t = trainer(
        ZeroStrategy(stage=stage, state_dict_type=state_dict_type),
        max_steps=5,
        enable_checkpointing=True,
        callbacks=[state, FileSizeLimit(failing_rank, at_step=3), ckpt],
        **COMMON,
    )
    error = error_of(lambda: t.fit(Wide(), loader()))
    lift_file_size_limit()
    out = {"errors": every_rank(error), "steps_run": t.global_step}
    path = out_dir / "ckpt.ckpt"
    probe = RestoredProbe()
    resumed = trainer(ZeroStrategy(stage=stage), max_steps=3, callbacks=[probe], **COMMON)
    resumed.fit(Wide(), loader(), ckpt_path=path)
    if RANK == 0:
        entry = inspect_checkpoint(path, verify=True)
        out.update(
            leftovers=leftovers(out_dir),
            status=entry.status,
            saved_step=entry.global_step,
            restored_diff=max_diff(probe.params, state.params[2]),
            resumed_steps=resumed.global_step,
        )
    return out


# ---------------------------------------------------------------------- asynchronous saves
def run_saving_every_epoch(directory: Path, stage: int, async_save: bool) -> L.Trainer:
    L.seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1)
    t = trainer(
        ZeroStrategy(stage=stage, async_save=async_save),
        max_epochs=3,
        enable_checkpointing=True,
        callbacks=[ckpt],
        **COMMON,
    )
    t.fit(Wide(), loader(SHORT_EPOCHS))
    return t


def consolidated(path: Path) -> dict:
    from lightning_zero.checkpoint.consolidate import consolidate

    out = consolidate(path, path.with_name(path.name + ".pt"), include_optimizer=True)
    return torch.load(out, weights_only=True)


NAMES = ("epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt")


def async_exact(directory: Path, stage: int = 2) -> dict:
    """Saving asynchronously after every epoch writes the same checkpoints as saving synchronously (though the
    training loop changes the parameters in place right after each save returns), and resuming from one
    ends where the uninterrupted run ends."""
    sync = run_saving_every_epoch(directory / f"sync-s{stage}", stage, async_save=False)
    final_params, final_optim = final_state(sync)
    background = run_saving_every_epoch(directory / f"async-s{stage}", stage, async_save=True)
    params, optim = final_state(background)
    L.seed_everything(7)
    torch.manual_seed(123)  # a different RNG state: the checkpoint's is restored
    resumed = trainer(ZeroStrategy(stage=stage), max_epochs=3, **COMMON)
    resumed.fit(Wide(), loader(SHORT_EPOCHS), ckpt_path=directory / f"async-s{stage}" / NAMES[0])
    resumed_params, resumed_optim = final_state(resumed)
    out = {}
    if RANK == 0:
        files = {}
        for name in NAMES:
            a = consolidated(directory / f"async-s{stage}" / name)
            s = consolidated(directory / f"sync-s{stage}" / name)
            files[name] = max(max_diff(a["state_dict"], s["state_dict"]), _optimizer_diff(a, s))
        out = {
            "checkpoint_diff": files,
            "training_diff": max(max_diff(params, final_params), optim_diff(optim, final_optim)),
            "resumed_diff": max(max_diff(resumed_params, final_params), optim_diff(resumed_optim, final_optim)),
            "entries": sorted(
                f"{e.path.name}:{e.status}" for e in list_checkpoints(directory / f"async-s{stage}", verify=True)
            ),
        }
    return out


def _optimizer_diff(a: dict, b: dict) -> float:
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    return max((sa[i][k].double() - sb[i][k].double()).abs().max().item() for i in sb for k in sb[i])


class CompleteCheckpoints(L.Callback):
    """Rank 0, before every step: how many complete checkpoints the directory holds."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.counts = directory, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if RANK == 0:
            self.counts.append(sum(e.complete for e in list_checkpoints(self.directory)))

    def fewest_once_one_existed(self) -> int:
        """The fewest complete checkpoints the directory held after it first held one."""
        first = next(i for i, count in enumerate(self.counts) if count)
        return min(self.counts[first:])


def async_top_k(directory: Path) -> dict:
    """save_top_k=1 removes the previous best after each new best: with asynchronous saves the removal waits
    for the new checkpoint to be complete, so once the directory holds a complete checkpoint it never lacks
    one, and it ends as a sync run's."""
    out = {}
    for mode in ("sync", "async"):
        where = directory / f"topk-{mode}"
        counter = CompleteCheckpoints(where)
        L.seed_everything(7)
        ckpt = ModelCheckpoint(dirpath=where, monitor="train_loss", mode="min", save_top_k=1, every_n_train_steps=1)
        t = trainer(
            ZeroStrategy(stage=2, async_save=mode == "async"),
            max_steps=4,
            enable_checkpointing=True,
            callbacks=[counter, ckpt],
            **COMMON,
        )
        t.fit(Wide(), loader())
        if RANK == 0:
            out[mode] = {
                "entries": sorted(p.name for p in where.iterdir()),
                "best": Path(ckpt.best_model_path).name,
                "min_complete": counter.fewest_once_one_existed(),
            }
    return out


def async_failure(directory: Path) -> dict:
    """Rank 1 cannot write from step 2 on: the save started at step 2 fails in the background; the next save
    raises that failure on every rank, and step 1's checkpoint is intact, with no temporaries left."""
    where = directory / "async-failure"
    L.seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=where, filename="ckpt", every_n_train_steps=1, save_top_k=1)
    state = StateAt()
    t = trainer(
        ZeroStrategy(stage=2, async_save=True),
        max_steps=5,
        enable_checkpointing=True,
        callbacks=[state, FileSizeLimit(1, at_step=2), ckpt],
        **COMMON,
    )
    error = error_of(lambda: t.fit(Wide(), loader()))
    lift_file_size_limit()
    out = {"errors": every_rank(error), "steps_run": t.global_step}
    collectives.barrier()
    if RANK == 0:
        entry = inspect_checkpoint(where / "ckpt.ckpt", verify=True)
        restored = consolidated(where / "ckpt.ckpt")["state_dict"]
        out.update(
            leftovers=leftovers(where),
            status=entry.status,
            saved_step=entry.global_step,
            intact_diff=max_diff(restored, state.params[1]),
        )
    return out


# ---------------------------------------------------------------------- leftovers of interrupted saves
class DirectoryAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.entries = sorted(p.name for p in Path(trainer.checkpoint_callback.dirpath).iterdir())


def temporaries(directory: Path) -> dict:
    """A run start removes the temporaries interrupted saves left in its ModelCheckpoint directory (and puts
    back a previous checkpoint that a save had moved aside), never anything else; the next save of a path
    removes that path's temporaries."""
    where = directory / "leftovers"
    other = directory / "elsewhere"
    L.seed_everything(7)
    first = trainer(ZeroStrategy(stage=2), max_steps=1, **COMMON)
    first.fit(Wide(), loader())
    first.save_checkpoint(where / "keep.ckpt")
    if RANK == 0:
        shutil.copytree(where / "keep.ckpt", where / ".last.ckpt.tmp-0123abcd")  # a dead sharded writer
        (where / ".model.ckpt.tmp-89abcdef").write_bytes(b"partial")  # a dead full writer
        shutil.copytree(where / "keep.ckpt", where / ".moved.ckpt.old-00c0ffee")  # killed between two renames
        (where / ".keep.ckpt.old-0badcafe").mkdir()  # killed while removing the old copy
        (where / ".hidden").write_text("not ours")
        other.mkdir()
        (other / ".ckpt.tmp-feedbeef").mkdir()
    collectives.barrier()
    probe = DirectoryAtStart()
    ckpt = ModelCheckpoint(dirpath=where, filename="never", every_n_train_steps=100)
    t = trainer(ZeroStrategy(stage=2), max_steps=1, enable_checkpointing=True, callbacks=[probe, ckpt], **COMMON)
    t.fit(Wide(), loader())
    t.save_checkpoint(other / "ckpt")
    out = {}
    if RANK == 0:
        out = {
            "at_start": probe.entries,
            "moved_back": inspect_checkpoint(where / "moved.ckpt", verify=True).status,
            "elsewhere": sorted(p.name for p in other.iterdir()),
        }
    return out


# ---------------------------------------------------------------------- damaged checkpoints given to fit
def damaged_resumes(directory: Path) -> dict:
    """A few damaged copies of a good checkpoint through ``fit(ckpt_path=...)`` on 2 ranks: every rank raises
    an error naming the file (the in-process fuzz covers the many cases)."""
    L.seed_everything(7)
    first = trainer(ZeroStrategy(stage=2), max_steps=2, **COMMON)
    first.fit(Wide(), loader())
    first.save_checkpoint(directory / "good")
    first.strategy.zero_config = ZeroStrategy(stage=2, state_dict_type="full").zero_config
    first.save_checkpoint(directory / "good.ckpt")
    cases = {
        "manifest_truncated": ("good", "manifest.json", "truncate"),
        "metadata_flipped": ("good", ".metadata", "flip"),
        "rank1_shard_flipped": ("good", "__1_0.distcp", "flip"),
        "full_truncated": ("good.ckpt", None, "truncate"),
        "full_flipped": ("good.ckpt", None, "flip"),
    }
    if RANK == 0:
        for name, (source, file, how) in cases.items():
            target = directory / f"damaged-{name}"
            (shutil.copytree if (directory / source).is_dir() else shutil.copy)(directory / source, target)
            damage(target / file if file else target, how)
    collectives.barrier()
    out = {}
    for name in cases:
        run = trainer(ZeroStrategy(stage=2), max_steps=3, **COMMON)
        out[name] = every_rank(error_of(lambda: run.fit(Wide(), loader(), ckpt_path=directory / f"damaged-{name}")))
    return out


def damage(file: Path, how: str) -> None:
    data = bytearray(file.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:  # a byte in the middle: inside the tensor data of a shard or a full file
        data[len(data) // 2] ^= 0x5A
    file.write_bytes(bytes(data))


CASES = {
    "disk_full": lambda d: {"sharded_r1": disk_full(d, "sharded", 1), "full_r0": disk_full(d, "full", 0)},
    "disk_full_matrix": lambda d: {
        "sharded_r0": disk_full(d, "sharded", 0),
        "sharded_r1_s3": disk_full(d, "sharded", 1, stage=3),
        "full_r0_s3": disk_full(d, "full", 0, stage=3),
    },
    "async_exact": lambda d: {"stage2": async_exact(d, 2)},
    "async_exact_matrix": lambda d: {"stage3": async_exact(d, 3), "stage1": async_exact(d, 1)},
    "async_top_k": async_top_k,
    "async_failure": async_failure,
    "temporaries": temporaries,
    "damaged_resumes": damaged_resumes,
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
