"""Rank program for checkpoint tests: exact resume, resharding, atomicity, corruption (pattern: worker_core)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import state_dicts
from lightning_zero.engine.comm import collectives
from tests.distributed import models
from tests.distributed.worker_core import RANK, WORLD, max_diff, run_scale, trainer
from tests.launch import run_cases_with_directory

COMMON = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
DATA = models.IndexedData(n=48)  # 3 optimizer steps per epoch on 2 ranks: 48 / 2 ranks / 4 per batch / 2 micro


def final_state(t: L.Trainer) -> tuple[dict, dict]:
    return t.strategy.full_state_dict(), state_dicts.full_optimizer_state(
        t.optimizers[0], t.lightning_module, t.strategy.engine
    )


def optim_diff(a: dict, b: dict) -> float:
    return max(
        (a["state"][i][k].double() - b["state"][i][k].double()).abs().max().item()
        for i in b["state"]
        for k in b["state"][i]
    )


def optim_scale(optim: dict) -> dict:
    """What reordered-fp32 bounds on a run's weights and optimizer state are derived from (``tests/tolerances.py``),
    read from its full optimizer state: the largest learning rate its param groups started at, and the largest
    element of its moments."""
    return {
        "lr": max(max(g.get("initial_lr", 0.0), g["lr"]) for g in optim["param_groups"]),
        "moment_scale": max(
            v.double().abs().max().item()
            for entry in optim["state"].values()
            for v in entry.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
    }


def straight(stage: int, **strategy_kwargs) -> tuple[dict, dict]:
    L.seed_everything(7)
    t = trainer(ZeroStrategy(stage=stage, **strategy_kwargs), max_epochs=2, **COMMON)
    t.fit(models.Regression(), models.loader(DATA, 4))
    return final_state(t)


def interrupted(
    save_stage: int,
    resume_stage: int,
    directory: Path,
    state_dict_type: str = "sharded",
    save_kwargs: dict | None = None,
    resume_kwargs: dict | None = None,
) -> tuple[dict, dict, int]:
    """One epoch at ``save_stage`` with ModelCheckpoint, then a new Trainer resumes for the second epoch
    (``*_kwargs``: more ZeroStrategy settings for either run)."""
    L.seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    strategy = ZeroStrategy(stage=save_stage, state_dict_type=state_dict_type, **(save_kwargs or {}))
    first = trainer(strategy, max_epochs=1, enable_checkpointing=True, callbacks=[ckpt], **COMMON)
    first.fit(models.Regression(), models.loader(DATA, 4))
    path = first.strategy.broadcast(ckpt.best_model_path or str(directory / "epoch=0.ckpt"))
    L.seed_everything(7)  # same script, same seed (Lightning seeds the DistributedSampler with it)
    torch.manual_seed(123)  # ... but a different RNG state: the checkpoint's must be restored
    second = trainer(ZeroStrategy(stage=resume_stage, **(resume_kwargs or {})), max_epochs=2, **COMMON)
    second.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=path)
    return (*final_state(second), second.global_step)


def resumed_pairs(directory: Path, pairs: list[tuple[str, int, int, str]], settings: dict) -> dict:
    """:func:`interrupted` against :func:`straight` for each ``(name, save stage, resume stage, state_dict_type)``,
    both runs with ``settings``."""
    out: dict = {}
    for name, save_stage, resume_stage, kind in pairs:
        expected, expected_optim = straight(resume_stage, **settings)
        got, got_optim, steps = interrupted(
            save_stage, resume_stage, directory / name, kind, save_kwargs=settings, resume_kwargs=settings
        )
        out[name] = {"steps": steps}
        if RANK == 0:
            out[name].update(param_diff=max_diff(got, expected), optim_diff=optim_diff(got_optim, expected_optim))
    return out


def scheduled_accumulation(directory: Path) -> dict:
    """A ``GradientAccumulationScheduler`` (1 micro-batch in epoch 0, 3 from epoch 1): interrupted after the first
    window of epoch 1 (mid-epoch, step 7 of 10), resumed by a new Trainer, against the uninterrupted run. Lightning
    runs no ``on_train_epoch_start`` for the epoch it resumes, where the scheduler sets the trainer's accumulation."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def run(stage: int, max_steps: int, ckpt_path: str | None = None, save_to: Path | None = None) -> L.Trainer:
        L.seed_everything(7)
        callbacks: list = [GradientAccumulationScheduler({0: 1, 1: 3})]
        if save_to is not None:
            callbacks.append(ModelCheckpoint(dirpath=save_to, filename="{step}", save_top_k=-1, every_n_train_steps=1))
        t = trainer(
            ZeroStrategy(stage=stage),
            max_steps=max_steps,
            enable_checkpointing=save_to is not None,
            callbacks=callbacks,
            gradient_clip_val=0.5,
        )
        t.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=ckpt_path)
        return t

    out = {}
    for stage in (2, 3):
        straight_run = run(stage, 10)
        expected = straight_run.strategy.full_state_dict()
        run(stage, 7, save_to=directory / f"gas{stage}")
        resumed = run(stage, 10, ckpt_path=str(directory / f"gas{stage}" / "step=7.ckpt"))
        params = resumed.strategy.full_state_dict()
        if RANK == 0:
            out[f"stage{stage}"] = {
                "steps": resumed.global_step,
                "accumulate": resumed.accumulate_grad_batches,
                "param_diff": max_diff(params, expected),
            }
    return out


class LateHead(models.Regression):
    """A second head used from optimizer step 2 on: saved at step 1, AdamW holds no state for it yet."""

    def __init__(self) -> None:
        super().__init__()
        self.late = torch.nn.Linear(models.IN, models.OUT)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + self.late(batch[0]).square().mean() if self.global_step >= 2 else loss


def stateless_at_save(directory: Path) -> dict:
    """A sharded checkpoint saved while a layer has no optimizer state (each stage, offloaded too), resumed at the
    same and another stage, against the uninterrupted run: the layer's first step after the resume starts its state
    as torch's does, with a step count of 0."""

    def run(stage: int, steps: int, ckpt_path: str | None = None, save_to: Path | None = None, **options) -> L.Trainer:
        L.seed_everything(7)
        saving = ModelCheckpoint(dirpath=save_to, filename="{step}", save_top_k=-1, every_n_train_steps=1)
        callbacks = [saving] if save_to else []
        t = trainer(
            ZeroStrategy(stage=stage, **options),
            max_steps=steps,
            enable_checkpointing=bool(save_to),
            callbacks=callbacks,
            gradient_clip_val=0.5,
        )
        t.fit(LateHead(), models.loader(DATA, 4), ckpt_path=ckpt_path)
        return t

    out = {}
    for save, resume, options in ((2, 2, {}), (3, 1, {}), (1, 3, dict(offload_optimizer=True))):
        expected = run(resume, 4, **options).strategy.full_state_dict()
        run(save, 1, save_to=directory / f"stateless{save}{resume}", **options)
        resumed = run(resume, 4, ckpt_path=str(directory / f"stateless{save}{resume}" / "step=1.ckpt"), **options)
        params = resumed.strategy.full_state_dict()
        if RANK == 0:
            out[f"{save}->{resume}"] = {"steps": resumed.global_step, "param_diff": max_diff(params, expected)}
    return out


#: (save stage, resume stage): `make test`'s; the other pairs (stage 3's save into stage 1 is in test_hybrid.py's).
RESUME_PAIRS = ((2, 2), (3, 3), (2, 3), (2, 1))
RESUME_PAIRS_FULL = ((1, 1), (3, 2))


def exact_resume(directory: Path, pairs=RESUME_PAIRS) -> dict:
    out = {}
    for save_stage, resume_stage in pairs:
        ref_params, ref_optim = straight(resume_stage)
        params, optim, steps = interrupted(save_stage, resume_stage, directory / f"{save_stage}-{resume_stage}")
        if RANK == 0:
            out[f"{save_stage}->{resume_stage}"] = {
                "steps": steps,
                "param_diff": max_diff(params, ref_params),
                "optim_diff": optim_diff(optim, ref_optim),
                **optim_scale(ref_optim),
            }
    return out


class RestoredProbe(L.Callback):
    """What a resumed run holds before its first step, gathered back to full tensors."""

    def on_train_start(self, trainer, pl_module):
        self.params = trainer.strategy.full_state_dict()
        self.optim = state_dicts.full_optimizer_state(trainer.optimizers[0], pl_module, trainer.strategy.engine)


def save_for_other_world(directory: Path, **strategy_kwargs) -> dict:
    """Stage 2 (``strategy_kwargs``: more settings): a sharded directory and a full file, plus the full state
    they hold."""
    L.seed_everything(7)
    t = trainer(ZeroStrategy(stage=2, **strategy_kwargs), max_steps=3, **COMMON)
    t.fit(models.Regression(), models.loader(DATA, 4))
    t.save_checkpoint(directory / "sharded")
    t.strategy.zero_config = ZeroStrategy(stage=2, state_dict_type="full", **strategy_kwargs).zero_config
    t.save_checkpoint(directory / "full.ckpt")
    params, optim = final_state(t)
    if RANK == 0:
        torch.save({"params": params, "optim": optim}, directory / "expected.pt")
    return {}


def resume_in_other_world(directory: Path, **strategy_kwargs) -> dict:
    """Whatever this world size is: resume both formats at stage 3 (``strategy_kwargs``: more settings) and
    compare with what was saved."""
    expected = torch.load(directory / "expected.pt", weights_only=True)
    out = {"world": WORLD}
    for name in ("sharded", "full.ckpt"):
        probe = RestoredProbe()
        L.seed_everything(7)
        t = trainer(ZeroStrategy(stage=3, **strategy_kwargs), max_steps=5, callbacks=[probe], **COMMON)
        t.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=str(directory / name))
        if RANK == 0:
            out[name] = {
                "param_diff": max_diff(probe.params, expected["params"]),
                "optim_diff": optim_diff(probe.optim, expected["optim"]),
                "steps": t.global_step,
            }
    return out


class UnpicklableOnRank1(torch.nn.Module):
    """Extra module state that cannot be serialised on rank 1: a writer failing mid-save."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def get_extra_state(self):
        return (lambda: None) if self.fail and RANK == 1 else {"ok": True}

    def set_extra_state(self, state) -> None:
        pass


class FragileRegression(models.Regression):
    def __init__(self) -> None:
        super().__init__()
        self.extra = UnpicklableOnRank1()


def crash_mid_save(directory: Path) -> dict:
    L.seed_everything(7)
    module = FragileRegression()
    t = trainer(ZeroStrategy(stage=2), max_steps=2, **COMMON)
    t.fit(module, models.loader(DATA, 4))
    good = directory / "good"
    t.save_checkpoint(good)
    before = t.strategy.full_state_dict()
    module.extra.fail = True
    out = {}
    try:
        t.save_checkpoint(good)  # overwrite attempt that dies in rank 1's writer
        t.save_checkpoint(directory / "new")
        out["error"] = None
    except Exception as err:  # the behaviour under test
        out["error"] = type(err).__name__
    t.strategy.barrier()
    if RANK == 0:
        out["entries"] = sorted(p.name for p in directory.iterdir())
        from lightning_zero.checkpoint.consolidate import consolidate

        restored = torch.load(consolidate(good, directory / "good.pt"), weights_only=True)
        before = {k: v for k, v in before.items() if isinstance(v, torch.Tensor)}
        out["good_diff"] = max_diff(restored, before)
    return out


def mismatched_model(directory: Path) -> dict:
    L.seed_everything(7)
    t = trainer(ZeroStrategy(stage=2), max_steps=1, **COMMON)
    t.fit(models.Regression(), models.loader(DATA, 4))
    t.save_checkpoint(directory / "m")

    class Wider(models.Regression):
        def __init__(self):
            super().__init__()
            self.net.head = torch.nn.Linear(7, 5)
            self.net.extra = torch.nn.Linear(2, 2)

    try:
        trainer(ZeroStrategy(stage=3), max_steps=2, **COMMON).fit(
            Wider(), models.loader(DATA, 4), ckpt_path=str(directory / "m")
        )
        return {"error": None}
    except Exception as err:  # the behaviour under test
        return {"error": type(err).__name__, "message": str(err)}


class EditedCheckpoints(models.Regression):
    """Adds an entry of its own in ``on_save_checkpoint`` and drops the head from the saved ``state_dict``, so it
    resumes with ``strict_loading = False`` (the head keeps the values it has); records what ``on_load_checkpoint``
    is given."""

    strict_loading = False

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict = {}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["vocabulary"] = {"a": 0, "b": 1}
        for key in [k for k in checkpoint["state_dict"] if k.startswith("net.head.")]:
            del checkpoint["state_dict"][key]

    def on_load_checkpoint(self, checkpoint):
        self.loaded = {"vocabulary": checkpoint.get("vocabulary"), "keys": sorted(checkpoint["state_dict"])}


def edited_and_lenient(directory: Path) -> dict:
    """Each format: a checkpoint edited in ``on_save_checkpoint`` at stage 2, resumed at stage 3."""
    out = {}
    for kind, name in (("sharded", "edited"), ("full", "edited.ckpt")):
        L.seed_everything(7)
        t = trainer(ZeroStrategy(stage=2, state_dict_type=kind), max_steps=1, **COMMON)
        t.fit(EditedCheckpoints(), models.loader(DATA, 4))
        t.save_checkpoint(directory / name)
        saved = (
            sorted(
                k.removeprefix("/state_dict/")
                for k in models.saved_tensors(directory / name)
                if k.startswith("/state_dict/")
            )
            if RANK == 0
            else None
        )
        module = EditedCheckpoints()
        t = trainer(ZeroStrategy(stage=3, state_dict_type=kind), max_steps=2, **COMMON)
        t.fit(module, models.loader(DATA, 4), ckpt_path=str(directory / name))
        out[kind] = {"saved": saved, "loaded": module.loaded, "steps": t.global_step}
    return out


def top_k(directory: Path) -> dict:
    L.seed_everything(7)
    ckpt = ModelCheckpoint(
        dirpath=directory / "topk",
        monitor="train_loss",
        mode="min",
        save_top_k=2,
        save_last=True,
        every_n_train_steps=1,
    )
    t = trainer(ZeroStrategy(stage=3), max_steps=5, enable_checkpointing=True, callbacks=[ckpt], **COMMON)
    t.fit(models.Regression(), models.loader(DATA, 4))
    t.strategy.barrier()
    return {"entries": sorted(p.name for p in (directory / "topk").iterdir()), "best": Path(ckpt.best_model_path).name}


def corrupted(directory: Path) -> dict:
    """Resume from a copy of the sharded checkpoint whose first shard file was truncated."""
    import shutil

    broken = directory / "broken"
    if RANK == 0:
        shutil.copytree(directory / "sharded", broken)
        shard = sorted(broken.glob("__*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:-16])
    try:
        trainer(ZeroStrategy(stage=2), max_steps=5, **COMMON).fit(
            models.Regression(), models.loader(DATA, 4), ckpt_path=str(broken)
        )
        return {"error": None}
    except Exception as err:  # the behaviour under test
        return {"error": type(err).__name__, "message": str(err)}


class PartlyFrozen(models.Regression):
    """An optimizer built over all parameters while one layer is frozen for the whole run."""

    def __init__(self) -> None:
        super().__init__()
        self.net.inp.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def frozen_and_weights_only(directory: Path) -> dict:
    out = {}
    for stage in (2, 3):
        L.seed_everything(7)
        t = trainer(ZeroStrategy(stage=stage), max_steps=2, **COMMON)
        t.fit(PartlyFrozen(), models.loader(DATA, 4))
        t.save_checkpoint(directory / f"frozen{stage}")
        t.save_checkpoint(directory / f"weights{stage}", weights_only=True)
        probe = RestoredProbe()
        t2 = trainer(ZeroStrategy(stage=stage), max_steps=3, callbacks=[probe], **COMMON)
        t2.fit(PartlyFrozen(), models.loader(DATA, 4), ckpt_path=str(directory / f"frozen{stage}"))
        saved = t.strategy.full_state_dict()
        entry = {"resumed_steps": t2.global_step, "param_diff": max_diff(probe.params, saved) if RANK == 0 else None}
        try:
            trainer(ZeroStrategy(stage=stage), max_steps=3, **COMMON).fit(
                PartlyFrozen(), models.loader(DATA, 4), ckpt_path=str(directory / f"weights{stage}")
            )
            entry["weights_only_error"] = None
        except Exception as err:  # the behaviour under test: Lightning's own clear refusal
            entry["weights_only_error"] = str(err)
        out[f"stage{stage}"] = entry
    return out


def malicious(directory: Path) -> dict:
    """A good sharded checkpoint, then copies with a code-running payload in place of ``.metadata`` (plain
    pickle) or ``meta.pt`` (a torch archive), manifest updated to match, and a full ``.ckpt`` file that is such
    an archive: every resume refuses it on every rank, and the payload never runs."""
    import shutil

    from tests.distributed.malicious import RunsShell, plant

    L.seed_everything(7)
    first = trainer(ZeroStrategy(stage=2), max_steps=2, **COMMON)
    first.fit(models.Regression(), models.loader(DATA, 4))
    first.save_checkpoint(directory / "good")
    cases = {"metadata": (".metadata", "pickle"), "meta": ("meta.pt", "torch"), "full": (None, "torch")}
    if RANK == 0:
        for name, (file, how) in cases.items():
            target, marker = directory / f"evil_{name}", directory / f"PWNED_{name}"
            if file is None:
                torch.save({"state_dict": {}, "payload": RunsShell(marker)}, target)
            else:
                shutil.copytree(directory / "good", target)
                plant(target, file, marker, how=how)
    first.strategy.barrier()
    out = {}

    def attempt(key: str, marker: str, call) -> None:
        try:
            call()
            out[key] = {"error": None}
        except Exception as err:  # noqa: BLE001 - the test asserts on what the user sees
            out[key] = {"error": type(err).__name__, "message": str(err).splitlines()[0]}
        out[key]["ran"] = (directory / f"PWNED_{marker}").exists()

    for name in cases:
        second = trainer(ZeroStrategy(stage=2), max_steps=3, **COMMON)
        attempt(
            name,
            name,
            lambda: second.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=directory / f"evil_{name}"),
        )
    # The other Trainer entry points that take `ckpt_path`, and pretrained weights (`init_weights`).
    for fn in ("validate", "test", "predict"):
        for name in ("metadata", "meta"):
            evaluator = trainer(ZeroStrategy(stage=2), max_steps=1)
            loader = models.loader(DATA, 4)
            attempt(
                f"{fn}_{name}",
                name,
                lambda: getattr(evaluator, fn)(Evaluated(), loader, ckpt_path=directory / f"evil_{name}"),
            )
    pretrained = trainer(ZeroStrategy(stage=2, init_weights=directory / "evil_full"), max_steps=1)
    attempt("init_weights", "full", lambda: pretrained.fit(models.Regression(), models.loader(DATA, 4)))
    from_directory = trainer(ZeroStrategy(stage=2, init_weights=directory / "evil_metadata"), max_steps=1)
    attempt("init_weights_sharded", "metadata", lambda: from_directory.fit(models.Regression(), models.loader(DATA, 4)))
    return out


class Evaluated(models.Regression):
    """The regression model with the evaluation hooks ``validate``/``test``/``predict`` call."""

    def validation_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def test_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


def saved_after_evaluation(directory: Path) -> dict:
    """``trainer.save_checkpoint`` after ``validate``, ``test`` and ``predict`` writes what it wrote right after
    ``fit`` (the fit's optimizers stay on the trainer, as under ``ddp``): stage 3 raised "Adam was not set up",
    stages 1-2 wrote no optimizer state. After weights loaded by ``validate(ckpt_path=...)`` it is refused, naming
    ``weights_only=True``, which still saves."""
    directory = Path(collectives.broadcast_object(str(directory)))
    out = {}
    for name, kwargs, precision in (
        ("stage1_full", {"stage": 1, "state_dict_type": "full"}, "32-true"),
        ("stage2_bf16_offload", {"stage": 2, "offload_optimizer": True}, "bf16-mixed"),
        ("stage3", {"stage": 3}, "32-true"),
    ):
        L.seed_everything(7)
        t = trainer(ZeroStrategy(**kwargs), max_steps=2, precision=precision, **COMMON)
        module, loader = Evaluated(), models.loader(DATA, 4)
        t.fit(module, loader)
        suffix = ".ckpt" if kwargs.get("state_dict_type") == "full" else ""
        t.save_checkpoint(directory / f"{name}_fitted{suffix}")
        t.validate(module, loader, verbose=False)
        t.test(module, loader, verbose=False)
        t.predict(module, loader)
        t.save_checkpoint(directory / f"{name}_evaluated{suffix}")
        out[name] = (
            models.compare_saved(directory / f"{name}_fitted{suffix}", directory / f"{name}_evaluated{suffix}")
            if RANK == 0
            else None
        )
    t.validate(module, loader, ckpt_path=directory / "stage3_fitted", verbose=False)
    try:
        t.save_checkpoint(directory / "after_loading")
        out["after_loading"] = None
    except RuntimeError as err:  # the behaviour under test: a refusal that names the way out
        out["after_loading"] = str(err)
    t.save_checkpoint(directory / "after_loading_weights", weights_only=True)
    return out


def continued_after_fit(directory: Path) -> dict:
    """``trainer.save_checkpoint`` after ``fit`` returned (mid-epoch, and after an epoch's last step), then a new
    Trainer continues to a later ``max_steps``: the same parameters as Lightning ``ddp`` doing the same, and no
    warning that the data was skipped to another batch than Lightning's (see ``resume/position.py``)."""
    directory = Path(collectives.broadcast_object(str(directory)))
    out: dict = {}
    for stopped in (2, 3):  # 3 optimizer steps an epoch
        finals = {}
        for name in ("ddp", "zero2", "zero3"):
            path = directory / f"continued_{name}_{stopped}{'.ckpt' if name == 'ddp' else ''}"
            L.seed_everything(7)
            strategy = lambda: "ddp" if name == "ddp" else ZeroStrategy(stage=int(name[-1]))  # noqa: E731
            first = trainer(strategy(), max_steps=stopped, **COMMON)
            first.fit(models.Regression(), models.loader(DATA, 4))
            first.save_checkpoint(path)
            L.seed_everything(7)
            module = models.Regression()
            second = trainer(strategy(), max_steps=5, **COMMON)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                second.fit(module, models.loader(DATA, 4), ckpt_path=path)
            finals[name] = module.state_dict() if name == "ddp" else second.strategy.full_state_dict()
            out[f"{name} {stopped} lr"] = run_scale(second)["lr"]
            out[f"{name} {stopped} skipped"] = [
                str(w.message) for w in caught if "skipped the train data" in str(w.message)
            ]
            out[f"{name} {stopped} steps"] = second.global_step
        for name in ("zero2", "zero3"):
            out[f"{name} {stopped} diff"] = max_diff(finals[name], finals["ddp"]) if RANK == 0 else None
    return out


CASES = {
    "continued_after_fit": continued_after_fit,
    "saved_after_evaluation": saved_after_evaluation,
    "malicious": malicious,
    "frozen_and_weights_only": frozen_and_weights_only,
    "corrupted": corrupted,
    "exact_resume": exact_resume,
    "scheduled_accumulation": scheduled_accumulation,
    "exact_resume_full": lambda directory: exact_resume(directory / "full", RESUME_PAIRS_FULL),
    "save_for_other_world": save_for_other_world,
    "resume_in_other_world": resume_in_other_world,
    "crash_mid_save": crash_mid_save,
    "mismatched_model": mismatched_model,
    "edited_and_lenient": edited_and_lenient,
    "stateless_at_save": stateless_at_save,
    "top_k": top_k,
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
