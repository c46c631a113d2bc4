"""Rank program for Lightning features a user reaches for under ZeroStrategy (pattern: worker_core; 2 ranks)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning, EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.tuner import Tuner
from torch.distributed.tensor import DTensor

from lightning_zero import ZeroStrategy
from lightning_zero.demo.data import RandomTokenDataset
from lightning_zero.demo.gpt import GPTLightningModule
from tests.distributed import models, worker_precision
from tests.distributed.worker_core import RANK, max_diff, run_scale, trainer
from tests.launch import run_cases_with_directory


class TunableGPT(GPTLightningModule):
    """The demo GPT with its own data (``lr_find`` needs a train_dataloader) and an ``lr`` the tuner sets."""

    def train_dataloader(self):
        kwargs = worker_precision.GPT_KWARGS
        data = RandomTokenDataset(
            num_samples=200, block_size=kwargs["block_size"], vocab_size=kwargs["vocab_size"], seed=5
        )
        return models.loader(data, worker_precision.BATCH)


def lr_find(strategy, directory: Path) -> dict:
    """``Tuner.lr_find`` saves a checkpoint before its search (the optimizer has no state yet), searches, restores
    the checkpoint and sets the suggestion; then ``fit`` trains with it."""
    L.seed_everything(3)
    module = TunableGPT(**worker_precision.GPT_KWARGS)
    t = trainer(strategy, max_steps=3, default_root_dir=directory)
    finder = Tuner(t).lr_find(module, min_lr=1e-4, max_lr=1.0, num_training=20, attr_name="learning_rate")
    t.fit(module)
    if isinstance(strategy, ZeroStrategy):
        params = t.strategy.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {
        "suggestion": finder.suggestion(),
        "learning_rate": module.hparams.learning_rate,
        **run_scale(t),
        "losses": finder.results["loss"],
        "params": params,
    }


def lr_find_against_ddp(directory: Path) -> dict:
    """Every stage (sharded and full checkpoints) against Lightning ``ddp`` on the same module: the same search,
    suggestion and parameters after ``fit``."""
    runs = {"ddp": lr_find("ddp", directory / "ddp")}
    runs.update({f"stage{s}": lr_find(ZeroStrategy(stage=s), directory / f"lr{s}") for s in (1, 2, 3)})
    runs["stage2_full"] = lr_find(ZeroStrategy(stage=2, state_dict_type="full"), directory / "lr2full")
    ddp, ddp_params = runs["ddp"], runs["ddp"]["params"]
    out = {}
    for name, run in runs.items():
        params = run.pop("params")
        run["param_diff_vs_ddp"] = max_diff(params, ddp_params) if RANK == 0 else None
        run["loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(run["losses"], ddp["losses"]))
        out[name] = run
    return out


def trained_checkpoints(directory: Path) -> dict:
    """Sharded (stages 2 and 3, what ModelCheckpoint writes by default) and full checkpoints of the demo GPT built in
    ``configure_model``, with the full weights beside them (``*.weights.pt``) for the one-process loader's test."""
    out = {}
    for name, kwargs in (
        ("stage2", dict(stage=2)),
        ("stage3", dict(stage=3)),
        ("stage3_full", dict(stage=3, state_dict_type="full")),
    ):
        L.seed_everything(5)
        module = GPTLightningModule(**worker_precision.GPT_KWARGS, build_in_configure_model=True)
        t = trainer(ZeroStrategy(**kwargs), max_steps=3)
        t.fit(module, models.loader(worker_precision.gpt_data(), worker_precision.BATCH))
        path = directory / f"{name}.ckpt"
        t.save_checkpoint(path)
        weights = t.strategy.full_state_dict()
        if RANK == 0:
            torch.save(weights, directory / f"{name}.weights.pt")
        out[name] = str(path)
    return out


def swa(
    strategy,
    build_in_configure_model: bool = False,
    resume_from: Path | None = None,
    save_to: Path | None = None,
    epochs: int = 4,
) -> dict:
    """``StochasticWeightAveraging`` from epoch 2 of 4: the weights the module ends with (the average). With
    ``save_to`` a checkpoint per epoch; with ``resume_from`` the run starts from one."""
    L.seed_everything(9)
    module = GPTLightningModule(**worker_precision.GPT_KWARGS, build_in_configure_model=build_in_configure_model)
    callback = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=2, annealing_epochs=1)
    callbacks = [callback]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    t = trainer(strategy, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=save_to is not None)
    t.fit(module, models.loader(worker_precision.gpt_data(), worker_precision.BATCH), ckpt_path=resume_from)
    if isinstance(strategy, ZeroStrategy):
        params = t.strategy.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    # SWA's scheduler replaces the param groups' initial_lr by swa_lrs: the epochs before it ran at the module's
    return {
        "params": params,
        "epochs": t.current_epoch,
        "averaged": int(callback.n_averaged),
        **run_scale(t),
        "lr": max(run_scale(t)["lr"], module.hparams.learning_rate),
    }


def swa_against_ddp(directory: Path, stages=(1, 2, 3), configure_model: bool = True, resumed=(2, 3)) -> dict:
    """``stages`` (stage 3 also with the model built in ``configure_model``; ``resumed``: from a checkpoint taken
    while averaging) against Lightning ``ddp``."""
    ddp = swa("ddp")
    runs = {f"stage{s}": swa(ZeroStrategy(stage=s)) for s in stages}
    if configure_model:
        runs["stage3_configure_model"] = swa(ZeroStrategy(stage=3), build_in_configure_model=True)
    for stage in resumed:
        swa(ZeroStrategy(stage=stage), save_to=directory / f"swa{stage}", epochs=3)
        runs[f"stage{stage}_resumed"] = swa(
            ZeroStrategy(stage=stage), resume_from=directory / f"swa{stage}" / "epoch=2.ckpt"
        )
    out = {}
    for name, run in runs.items():
        params = run.pop("params")
        run["diff_vs_ddp"] = max_diff(params, ddp["params"]) if RANK == 0 else None
        out[name] = run
    out["ddp"] = {"epochs": ddp["epochs"], "averaged": ddp["averaged"]}
    return out


def ema(strategy, resume_from: Path | None = None, save_to: Path | None = None, epochs: int = 3) -> dict:
    """``EMAWeightAveraging`` over ``epochs`` epochs: the weights the module ends with (the average), and the loss
    of the last validation (the average swapped in). With ``save_to`` a checkpoint per epoch; with ``resume_from``
    the run starts from one."""
    L.seed_everything(9)
    module = GPTLightningModule(**worker_precision.GPT_KWARGS)
    callback = EMAWeightAveraging(decay=0.8)
    callbacks = [callback]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    t = trainer(
        strategy, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=save_to is not None, limit_val_batches=2
    )
    data = worker_precision.gpt_data()
    t.fit(
        module,
        models.loader(data, worker_precision.BATCH),
        models.loader(data, worker_precision.BATCH),
        ckpt_path=resume_from,
    )
    if isinstance(strategy, ZeroStrategy):
        params = t.strategy.full_state_dict()
    else:
        params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    average = callback._average_model.module.parameters()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in average]
    return {
        "params": params,
        "epochs": t.current_epoch,
        "averaged": int(callback._average_model.n_averaged),
        "val_loss": float(t.callback_metrics["val_loss"]),
        "average_bytes": sum(p.numel() * p.element_size() for p in local),
        **run_scale(t),
    }


def ema_resumed(directory: Path, runs: dict[str, tuple[str | dict, str | dict]]) -> dict:
    """``runs``: name -> (the saving run's strategy, the resumed run's: "ddp" or ZeroStrategy kwargs). The saving run
    writes a checkpoint per epoch and the resumed run starts from the one after epoch 1 of 3; both are compared with
    the resuming strategy's uninterrupted run and with Lightning ``ddp``'s."""
    build = lambda spec: spec if spec == "ddp" else ZeroStrategy(**spec)  # noqa: E731
    uninterrupted: dict[str, dict] = {"ddp": ema("ddp")}
    out = {}
    for name, (saving, resuming) in runs.items():
        key = resuming if resuming == "ddp" else repr(resuming)
        if key not in uninterrupted:
            uninterrupted[key] = ema(build(resuming))
        ema(build(saving), save_to=directory / f"ema_{name}", epochs=2)
        run = ema(build(resuming), resume_from=directory / f"ema_{name}" / "epoch=1.ckpt")
        run["same_strategy"] = saving == resuming  # the first epoch's arithmetic is the uninterrupted run's
        params = run.pop("params")
        for reference, ref_run in (("uninterrupted", uninterrupted[key]), ("ddp", uninterrupted["ddp"])):
            run[f"diff_vs_{reference}"] = max_diff(params, ref_run["params"]) if RANK == 0 else None
            run[f"val_loss_diff_vs_{reference}"] = abs(run["val_loss"] - ref_run["val_loss"])
        out[name] = run
    out["ddp"] = {key: uninterrupted["ddp"][key] for key in ("epochs", "averaged", "average_bytes")}
    return out


class AverageWitness(L.Callback):
    """The average a weight averaging callback should hold, from the whole weights it reads (kept on rank 0; the
    gathering is collective): an exponential one after every step (``decay``), or the mean of the weights at the
    start of each epoch in ``swa_epochs`` (``StochasticWeightAveraging``'s)."""

    def __init__(self, decay: float | None = None, swa_epochs: range | None = None) -> None:
        self.decay, self.swa_epochs = decay, swa_epochs
        self.average: dict[str, torch.Tensor] = {}
        self.count = 0

    def _add(self, trainer: L.Trainer) -> None:
        weights = trainer.strategy.full_state_dict()
        self.count += 1
        for name, w in weights.items():
            if name not in self.average:
                self.average[name] = w.clone()
            elif self.decay is not None:
                torch._foreach_lerp_([self.average[name]], [w], 1 - self.decay)  # torch's EMA, one tensor at a time
            else:
                self.average[name] += (w - self.average[name]) / self.count

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.decay is not None:
            self._add(trainer)

    def on_train_epoch_start(self, trainer, pl_module):
        if self.swa_epochs is not None and trainer.current_epoch in self.swa_epochs:
            self._add(trainer)


def witnessed_average(
    kind: str,
    strategy_kwargs: dict,
    precision: str = "32-true",
    resume_from: Path | None = None,
    save_to: Path | None = None,
    epochs: int = 3,
) -> dict:
    """The demo GPT under ``EMAWeightAveraging`` (``kind`` "ema") or ``StochasticWeightAveraging`` from epoch 2
    ("swa"), validated every epoch (the average swapped in and out), with a witness of the average it should end
    with."""
    L.seed_everything(9)
    module = GPTLightningModule(**worker_precision.GPT_KWARGS)
    if kind == "ema":
        callback, witness = EMAWeightAveraging(decay=0.8), AverageWitness(decay=0.8)
    else:
        callback, witness = (
            StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=2),
            AverageWitness(swa_epochs=range(1, epochs)),
        )
    callbacks = [callback, witness]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    t = trainer(
        ZeroStrategy(**strategy_kwargs),
        max_epochs=epochs,
        callbacks=callbacks,
        precision=precision,
        enable_checkpointing=save_to is not None,
        limit_val_batches=2,
    )
    data = worker_precision.gpt_data()
    t.fit(
        module,
        models.loader(data, worker_precision.BATCH),
        models.loader(data, worker_precision.BATCH),
        ckpt_path=resume_from,
    )
    params = t.strategy.full_state_dict()
    return {"params": params, "witness": witness.average, "updates": witness.count, "steps": t.global_step}


def witnessed_averages(directory: Path, cases: dict[str, tuple[str, dict, str]]) -> dict:
    """``cases``: name -> (kind, ZeroStrategy kwargs, precision). Each run against its witness, and resumed from the
    checkpoint after epoch 1 of 3 against the uninterrupted run. ``directory``: this group's own (ModelCheckpoint
    would not overwrite another group's file of the same name, but write beside it)."""
    out = {}
    for name, (kind, kwargs, precision) in cases.items():
        run = witnessed_average(kind, kwargs, precision)
        # SWA's schedule depends on max_epochs: its saving run must be the whole run
        witnessed_average(
            kind, kwargs, precision, save_to=directory / f"witnessed_{name}", epochs=2 if kind == "ema" else 3
        )
        resumed = witnessed_average(
            kind, kwargs, precision, resume_from=directory / f"witnessed_{name}" / "epoch=1.ckpt"
        )
        out[name] = {
            "updates": run["updates"],
            "steps": run["steps"],
            "diff_vs_witness": max_diff(run["params"], run["witness"]) if RANK == 0 else None,
            "resumed_diff": max_diff(resumed["params"], run["params"]) if RANK == 0 else None,
        }
    return out


PIPELINE = dict(pipeline_stages=2, microbatches=2)  # another stage's parameters are meta on each rank


def tour_averaged(strategy, kind: str) -> dict:
    """``models.Tour`` (BatchNorm, a frozen layer) for 4 epochs under EMA or SWA (from epoch 2, then its BatchNorm
    epoch): the weights and buffers it ends with, and each validation's metric, synced over the ranks."""
    L.seed_everything(5)
    module = models.Tour()
    callback = (
        EMAWeightAveraging(decay=0.8) if kind == "ema" else StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=2)
    )
    metrics = ValidationMetrics()
    t = trainer(strategy, max_epochs=4, limit_val_batches=2, callbacks=[callback, metrics])
    t.fit(module, models.loader(models.IndexedData(), 4), models.loader(models.IndexedData(), 4))
    state = (
        t.strategy.full_state_dict()
        if isinstance(strategy, ZeroStrategy)
        else {k: v.detach().clone() for k, v in module.state_dict().items()}
    )
    # SWA's scheduler replaces the param groups' initial_lr by swa_lrs: Tour's SGD started at 0.05, momentum 0.9
    return {"state": state, "val_mse": metrics.values, **run_scale(t), "lr": max(run_scale(t)["lr"], 0.05 / (1 - 0.9))}


class ValidationMetrics(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer, pl_module):
        self.values.append(float(trainer.callback_metrics["val_mse"]))


def averaging_with_batchnorm(stages=(2, 3)) -> dict:
    """Against Lightning ``ddp``: the state (BatchNorm statistics included) and every validation's metric."""
    out = {}
    for kind in ("ema", "swa"):
        ddp = tour_averaged("ddp", kind)
        for stage in stages:
            run = tour_averaged(ZeroStrategy(stage=stage), kind)
            out[f"{kind}_stage{stage}"] = {
                "diff_vs_ddp": max_diff(run["state"], ddp["state"]) if RANK == 0 else None,
                "val_mse_diffs": [abs(a - b) for a, b in zip(run["val_mse"], ddp["val_mse"])],
                "val_mse": ddp["val_mse"],
                "lr": run["lr"],
                "steps": run["steps"],
            }
    return out


class BlocksCompiledInConfigureModel(GPTLightningModule):
    """The configure_model route: the user compiles each block where the model is built."""

    def configure_model(self) -> None:
        super().configure_model()
        for block in self.model.blocks:
            block.compile(**getattr(self, "compile_options", {}))


def compiled(strategy, module_class=GPTLightningModule, compile_options: dict | None = None) -> dict:
    """3 steps of the demo GPT; the weights, and how many graphs dynamo compiled (0: eager)."""
    torch._dynamo.reset()
    L.seed_everything(13)
    module = module_class(**worker_precision.GPT_KWARGS)
    module.compile_options = compile_options or {}
    t = trainer(strategy, max_steps=3, gradient_clip_val=1.0)
    t.fit(module, models.loader(worker_precision.gpt_data(), worker_precision.BATCH))
    weights = (
        t.strategy.full_state_dict()
        if isinstance(strategy, ZeroStrategy)
        else {k: v.detach().clone() for k, v in module.state_dict().items()}
    )
    return {
        "weights": weights,
        "steps": t.global_step,
        "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
    }


@contextlib.contextmanager
def _host_vector_isa():
    """Inductor picks its vector ISA from ``ATEN_CPU_CAPABILITY`` as it generates code, and with ``default`` (the
    suite's, ``tests/conftest.py``) torch 2.13's C++ reductions use ``at::vec`` without including it: code is
    generated for this host's ISA, as in a user's run."""
    saved = os.environ.pop("ATEN_CPU_CAPABILITY", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ATEN_CPU_CAPABILITY"] = saved


def compile_against_eager(backend: str, stages=(1, 2, 3), configure_model: bool = True) -> dict:
    """``ZeroStrategy(compile=...)`` at ``stages`` and the configure_model route against the same blocks compiled
    under Lightning ``ddp`` (the same kernels), and eager ``ddp``; the refused route's message."""
    with _host_vector_isa():
        return _compile_against_eager(backend, stages, configure_model)


def _compile_against_eager(backend: str, stages, configure_model: bool) -> dict:
    options = {"backend": backend}
    references = {
        "ddp_eager": compiled("ddp"),
        "ddp_compiled": compiled("ddp", BlocksCompiledInConfigureModel, options),
    }
    runs = {f"stage{s}": compiled(ZeroStrategy(stage=s, compile=options)) for s in stages}
    if configure_model:
        runs["stage3_configure_model"] = compiled(ZeroStrategy(stage=3), BlocksCompiledInConfigureModel, options)
    out = {}
    for name, run in runs.items():
        weights = run.pop("weights")
        for ref, ref_run in references.items():
            run[f"diff_vs_{ref}"] = max_diff(weights, ref_run["weights"]) if RANK == 0 else None
        out[name] = run
    try:
        trainer(ZeroStrategy(stage=2), max_steps=1).fit(
            torch.compile(GPTLightningModule(**worker_precision.GPT_KWARGS))
        )
        out["refused"] = None
    except Exception as err:  # noqa: BLE001 - Lightning's own refusal is what the user sees
        out["refused"] = f"{type(err).__name__}: {err}"
    return out


class Finetune(L.LightningModule):
    """A backbone frozen before ``fit`` (``BaseFinetuning.freeze_before_training``) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)


class UnfreezeBackboneThenFreezeHead(BaseFinetuning):
    """Epoch 1: the backbone trains too, in a new param group (``unfreeze_and_add_param_group``); epoch 2: the head
    is frozen."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.02)
        if epoch == 2:
            for p in pl_module.head.parameters():
                p.requires_grad = False


FINETUNE_DATA = models.IndexedData(n=32, dim=8, out=3)
FINETUNE_BATCH, FINETUNE_EPOCHS = 4, 3


def finetune_reference(initial: dict, world: int) -> dict:
    """Plain single-process PyTorch doing the same: the global batch of every step, the same unfreezing."""
    module = Finetune()
    module.load_state_dict(initial)
    for p in module.backbone.parameters():
        p.requires_grad = False
    optimizer = module.configure_optimizers()
    steps = len(FINETUNE_DATA) // (world * FINETUNE_BATCH)
    batches = models.global_microbatches(FINETUNE_DATA, world, FINETUNE_BATCH, steps * FINETUNE_EPOCHS)
    for epoch in range(FINETUNE_EPOCHS):
        if epoch == 1:
            for p in module.backbone.parameters():
                p.requires_grad = True
            optimizer.add_param_group({"params": list(module.backbone.parameters()), "lr": 0.02})
        if epoch == 2:
            for p in module.head.parameters():
                p.requires_grad = False
        for ranks in batches[epoch * steps : (epoch + 1) * steps]:
            optimizer.zero_grad(set_to_none=True)
            (sum(module.training_step(batch, 0) for batch in ranks) / world).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def unfreezing(strategy) -> dict:
    """``BaseFinetuning`` unfreezing a backbone at epoch 1 and freezing the head at epoch 2, against plain PyTorch."""
    L.seed_everything(17)
    module = Finetune()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    t = trainer(strategy, max_epochs=FINETUNE_EPOCHS, callbacks=[UnfreezeBackboneThenFreezeHead()])
    t.fit(module, models.loader(FINETUNE_DATA, FINETUNE_BATCH))
    weights = (
        t.strategy.full_state_dict()
        if isinstance(strategy, ZeroStrategy)
        else {k: v.detach().clone() for k, v in module.state_dict().items()}
    )
    reference = finetune_reference(initial, world=t.world_size) if RANK == 0 else None
    changed = (
        max(float((initial[k] - reference[k]).abs().max()) for k in initial if k.startswith("backbone"))
        if RANK == 0
        else None
    )
    engine = getattr(t.strategy, "engine", None)
    return {
        "steps": t.global_step,
        "diff": max_diff(weights, reference) if RANK == 0 else None,
        "backbone_change": changed,
        "growths": getattr(engine, "growths", None),
    }


def averaged_while_unfreezing(stages) -> dict:
    """EMA and SWA (from epoch 2) while ``BaseFinetuning`` unfreezes the backbone at epoch 1: the average of a
    parameter that was frozen when averaging began, against a witness (``ddp`` does not train this: see
    ``test_ddp_does_not_average_parameters_frozen_when_it_wrapped_the_model``)."""
    out = {}
    for kind in ("ema", "swa"):
        for stage in stages:
            L.seed_everything(17)
            if kind == "ema":
                callback, witness = EMAWeightAveraging(decay=0.8), AverageWitness(decay=0.8)
            else:
                callback = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=2)
                witness = AverageWitness(swa_epochs=range(1, FINETUNE_EPOCHS))
            t = trainer(
                ZeroStrategy(stage=stage),
                max_epochs=FINETUNE_EPOCHS,
                callbacks=[UnfreezeBackboneThenFreezeHead(), callback, witness],
            )
            t.fit(Finetune(), models.loader(FINETUNE_DATA, FINETUNE_BATCH))
            params = t.strategy.full_state_dict()
            out[f"{kind}_stage{stage}"] = {
                "updates": witness.count,
                "steps": t.global_step,
                "diff_vs_witness": max_diff(params, witness.average) if RANK == 0 else None,
                "weight_scale": max(v.abs().max().item() for v in params.values()) if RANK == 0 else None,
            }
    return out


CASES = {
    "lr_find": lr_find_against_ddp,
    "checkpoints": trained_checkpoints,
    "swa": lambda directory: swa_against_ddp(directory, stages=(1,), configure_model=False, resumed=(3,)),
    "swa_rest": lambda directory: swa_against_ddp(directory, stages=(2, 3), resumed=(2,)),
    "compile": lambda directory: compile_against_eager("aot_eager", stages=(3,)),
    "compile_rest": lambda directory: compile_against_eager("aot_eager", stages=(1, 2), configure_model=False),
    "unfreezing": lambda directory: {
        "ddp": unfreezing("ddp"),
        **{f"stage{s}": unfreezing(ZeroStrategy(stage=s)) for s in (1, 2, 3)},
        "stage1_offload": unfreezing(ZeroStrategy(stage=1, offload_optimizer=True)),
        "stage2_offload": unfreezing(ZeroStrategy(stage=2, offload_optimizer=True)),
        # the backbone has no host master: it steps where it is, once, beside the host's parts
        "stage3_offload": unfreezing(ZeroStrategy(stage=3, offload_optimizer=True, unit_size_mb=0)),
    },
    "compile_inductor": lambda directory: compile_against_eager("inductor", stages=(2, 3)),
    "ema_resumed": lambda directory: ema_resumed(
        directory,
        {
            "stage3": (dict(stage=3), dict(stage=3)),
            "ddp_to_stage3": ("ddp", dict(stage=3)),
        },
    ),
    "averaging_pipeline": lambda directory: witnessed_averages(
        directory / "averaging_pipeline", {"ema_stage3": ("ema", dict(stage=3, **PIPELINE), "32-true")}
    ),
    "averaging_pipeline_rest": lambda directory: witnessed_averages(
        directory / "averaging_pipeline_rest",
        {
            "swa_stage3": ("swa", dict(stage=3, **PIPELINE), "32-true"),
            "ema_stage1": ("ema", dict(stage=1, **PIPELINE), "32-true"),
            "swa_stage1": ("swa", dict(stage=1, **PIPELINE), "32-true"),
        },
    ),
    "averaging_bf16": lambda directory: witnessed_averages(
        directory / "averaging_bf16", {"ema_stage2": ("ema", dict(stage=2), "bf16-mixed")}
    ),
    "averaging_batchnorm": lambda directory: averaging_with_batchnorm(stages=(3,)),
    "averaging_batchnorm_rest": lambda directory: averaging_with_batchnorm(stages=(2,)),
    "averaging_unfreezing": lambda directory: averaged_while_unfreezing(stages=(2,)),
    "averaging_unfreezing_rest": lambda directory: averaged_while_unfreezing(stages=(1, 3)),
    "averaging_bf16_rest": lambda directory: witnessed_averages(
        directory / "averaging_bf16_rest",
        {
            "swa_stage2": ("swa", dict(stage=2), "bf16-mixed"),
            "ema_stage1_offload": ("ema", dict(stage=1, offload_optimizer=True), "bf16-mixed"),
            "ema_stage2_full": ("ema", dict(stage=2, state_dict_type="full"), "bf16-mixed"),
            "swa_stage1": ("swa", dict(stage=1), "bf16-mixed"),
            "ema_pipeline_stage1": ("ema", dict(stage=1, **PIPELINE), "bf16-mixed"),
            "ema_stage3": ("ema", dict(stage=3), "bf16-mixed"),
        },
    ),
    # the masters after each update averaged, not the parameters forward used one update behind; resumed with the
    # pending update in the checkpoint
    "averaging_delayed": lambda directory: witnessed_averages(
        directory / "averaging_delayed",
        {
            "swa_stage2": ("swa", dict(stage=2, offload_optimizer=True, offload_step_delay=1), "32-true"),
            "ema_stage1": ("ema", dict(stage=1, offload_optimizer=True, offload_step_delay=1), "32-true"),
        },
    ),
    "ema_resumed_rest": lambda directory: ema_resumed(
        directory,
        {
            "stage2_offload_full": (dict(stage=2, offload_optimizer=True, state_dict_type="full"),) * 2,
            "stage2_async": (dict(stage=2, async_save=True),) * 2,
            "stage3_full": (dict(stage=3, state_dict_type="full"),) * 2,
            "stage1_offload": (dict(stage=1, offload_optimizer=True),) * 2,
            "stage3_to_stage2": (dict(stage=3), dict(stage=2)),
            "stage2_full_to_ddp": (dict(stage=2, state_dict_type="full"), "ddp"),
        },
    ),
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
