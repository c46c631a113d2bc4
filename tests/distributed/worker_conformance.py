"""Rank program for Lightning conformance: every built-in callback and the Trainer flags users combine with a
strategy, run on the same module under Lightning ``ddp`` and under each ZeRO stage (2 ranks). Each feature reports
what a user would see: whether it ran (or the error it raised), where training stopped, the metrics it logged, the
files it wrote, and how far the final weights are from ``ddp``'s."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import callbacks as cb
from lightning.pytorch.loggers import CSVLogger

from lightning_zero import ZeroStrategy, load_from_checkpoint
from lightning_zero.demo.data import RandomTokenDataset
from lightning_zero.demo.gpt import GPTLightningModule
from tests.distributed import models, worker_precision
from tests.distributed.worker_core import RANK, max_diff, trainer
from tests.launch import run_cases_with_directory

#: Without biases: the key projection's bias gets an exactly-zero gradient in exact arithmetic (softmax ignores a
#: shift of every key), so its float gradient is rounding noise that AdamW scales up to learning-rate-sized steps of
#: either sign, and two correct reduction orders (ddp's and ZeRO's) then end 5e-5 apart on it (measured).
KWARGS = {**worker_precision.GPT_KWARGS, "bias": False}


class Data(L.LightningDataModule):
    """Random tokens for every loop (train 12 batches per rank, validation/test/predict 2)."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size

    def _loader(self, samples: int, seed: int):
        data = RandomTokenDataset(
            num_samples=samples, block_size=KWARGS["block_size"], vocab_size=KWARGS["vocab_size"], seed=seed
        )
        return models.loader(data, self.batch_size)

    def train_dataloader(self):
        return self._loader(48, 1)

    def val_dataloader(self):
        return self._loader(8, 2)

    def test_dataloader(self):
        return self._loader(8, 3)

    def predict_dataloader(self):
        return self._loader(8, 4)


def _strategy(name: str):
    """``ddp``, ``zero<s>`` or ``zero<s>_offload`` (the optimizer on the host)."""
    if name == "ddp":
        return "ddp"
    return ZeroStrategy(stage=int(name[4]), offload_optimizer=name.endswith("_offload"))


def _weights(t: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    if isinstance(t.strategy, ZeroStrategy):
        return t.strategy.full_state_dict()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit(name: str, directory: Path, callbacks=(), after: Callable | None = None, **kwargs) -> dict[str, Any]:
    """Fit under strategy ``name``; what the user sees."""
    L.seed_everything(21)
    module = GPTLightningModule(**KWARGS)
    t = trainer(_strategy(name), callbacks=list(callbacks), default_root_dir=directory, **kwargs)
    observed: dict[str, Any] = {}
    try:
        t.fit(module, datamodule=Data())
        if after is not None:
            observed.update(after(name, t, module))
    except Exception as err:  # noqa: BLE001 - the outcome is what the user sees
        print(f"[rank {RANK}] {name} in {directory.parent.name}: {type(err).__name__}: {err}", file=sys.stderr)
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    metrics = {k: round(float(v), 6) for k, v in t.callback_metrics.items()}
    files = sorted(p.name for p in directory.rglob("*") if p.suffix in (".ckpt", ".csv")) if directory.exists() else []
    return {
        "error": None,
        "step": t.global_step,
        "epoch": t.current_epoch,
        "metrics": metrics,
        "files": files,
        "weights": _weights(t, module),
        **observed,
    }


def _resume_last(name: str, t: L.Trainer, module: L.LightningModule) -> dict:
    """After 3 epochs with ModelCheckpoint, a new Trainer continues to 4 from ``ckpt_path="last"``."""
    L.seed_everything(21)
    again = trainer(
        _strategy(name),
        default_root_dir=t.default_root_dir,
        max_epochs=4,
        enable_checkpointing=True,
        callbacks=[cb.ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)],
    )
    resumed = GPTLightningModule(**KWARGS)
    again.fit(resumed, datamodule=Data(), ckpt_path="last")
    return {"resumed_epoch": again.current_epoch, "resumed_weights": _weights(again, resumed)}


def _best(name: str, t: L.Trainer, module: L.LightningModule) -> dict:
    """``validate``/``test`` from ``ckpt_path="best"``: the best of ModelCheckpoint's kept checkpoints."""
    val = t.validate(module, datamodule=Data(), ckpt_path="best", verbose=False)
    test = t.test(module, datamodule=Data(), ckpt_path="best", verbose=False)
    return {
        "best": Path(t.checkpoint_callback.best_model_path).name,
        "validate": val[0]["val_loss"],
        "test": test[0]["test_loss"],
    }


def _weights_only(name: str, t: L.Trainer, module: L.LightningModule) -> dict:
    """``save_weights_only=True``: the last checkpoint holds the run's weights (as
    ``lightning_zero.load_from_checkpoint`` reads them) and no optimizer state, so resuming from it is refused with
    Lightning's own message."""
    path = Path(t.checkpoint_callback.last_model_path)
    loaded = load_from_checkpoint(GPTLightningModule, path, **KWARGS).state_dict()
    weights = _weights(t, module)
    again = trainer(_strategy(name), default_root_dir=t.default_root_dir, max_epochs=3)
    try:
        again.fit(GPTLightningModule(**KWARGS), datamodule=Data(), ckpt_path=path)
        refused = None
    except KeyError as err:  # the behaviour under test: Lightning's refusal, on every rank
        refused = str(err)[:120]
    return {"loaded_vs_run": max_diff(loaded, weights) if RANK == 0 else 0.0, "resume_refused": refused}


def _evaluate(name: str, t: L.Trainer, module: L.LightningModule) -> dict:
    val = t.validate(module, datamodule=Data(), verbose=False)
    test = t.test(module, datamodule=Data(), verbose=False)
    predictions = t.predict(module, datamodule=Data())
    return {
        "validate": val[0]["val_loss"],
        "test": test[0]["test_loss"],
        "predictions": sum(int(p.sum()) for p in predictions),
    }


def _lr_logged(name: str, t: L.Trainer, module: L.LightningModule) -> dict:
    """Rank 0's CSV log has the learning rate of each param group."""
    if RANK != 0:
        return {}
    header = next(Path(t.default_root_dir).rglob("metrics.csv")).read_text().splitlines()[0]
    return {"lr_columns": sorted(c for c in header.split(",") if c.startswith("lr-"))}


class TorchClipInHook(cb.Callback):
    """``torch.nn.utils.clip_grad_norm_`` on the module's ``p.grad`` in ``on_before_optimizer_step``: stage 3's
    DTensor gradients clip as FSDP2's do (stages 1-2 hold no full ``p.grad``: docs/lightning-features.md)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        torch.nn.utils.clip_grad_norm_(pl_module.parameters(), 0.05)


class LogGradNorms(cb.Callback):
    """What Lightning's docs log from ``on_before_optimizer_step``: each parameter's gradient norm and their total,
    through ``lightning_zero.grad_norm`` (Lightning's own ``grad_norm`` under ``ddp``)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning_zero import grad_norm

        pl_module.log_dict(grad_norm(pl_module.model, norm_type=2))


FEATURES: dict[str, dict[str, Any]] = {
    "accumulate_clip": dict(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5),
    "grad_norm": dict(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5, callbacks=[LogGradNorms()]),
    "torch_clip_in_hook": dict(max_steps=4, accumulate_grad_batches=2, callbacks=[TorchClipInHook()]),
    # The average is swapped in for validation, and moved into the module when training ends: the optimizer's own rows
    # (host copies under offload) must take it, or fit's end hands the module the trained weights back.
    "ema": dict(max_epochs=2, limit_train_batches=6, limit_val_batches=2, callbacks=[cb.EMAWeightAveraging(decay=0.9)]),
    "swa": dict(
        max_epochs=3,
        limit_train_batches=4,
        limit_val_batches=2,
        callbacks=[cb.StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)],
    ),
    "val_check_interval": dict(max_epochs=1, val_check_interval=3, limit_val_batches=2),
    "limit_batches": dict(max_epochs=2, limit_train_batches=3, limit_val_batches=1),
    "overfit_batches": dict(max_epochs=2, overfit_batches=2),
    "fast_dev_run": dict(fast_dev_run=2),
    "deterministic": dict(max_steps=3, deterministic=True),
    "detect_anomaly": dict(max_steps=2, detect_anomaly=True),
    "num_sanity_val_steps": dict(max_steps=2, num_sanity_val_steps=2),
    "max_time": dict(max_epochs=1000, max_time={"seconds": 2}),
    "early_stopping": dict(max_epochs=5, callbacks=[cb.EarlyStopping(monitor="val_loss", min_delta=10.0, patience=0)]),
    "lr_monitor": dict(max_steps=4, logger=True, callbacks=[cb.LearningRateMonitor()], after=_lr_logged),
    "grad_accum_scheduler": dict(max_epochs=2, callbacks=[cb.GradientAccumulationScheduler({0: 1, 1: 2})]),
    "model_summary": dict(max_steps=1, enable_model_summary=True, callbacks=[cb.ModelSummary(max_depth=2)]),
    "device_stats": dict(max_steps=2, logger=True, callbacks=[cb.DeviceStatsMonitor()]),
    "throughput": dict(
        max_steps=3, logger=True, callbacks=[cb.ThroughputMonitor(batch_size_fn=lambda b: b[0].size(0))]
    ),
    "batch_size_finder": dict(max_steps=2, callbacks=[cb.BatchSizeFinder()]),
    "checkpoint_last": dict(
        max_epochs=3,
        enable_checkpointing=True,
        callbacks=[cb.ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)],
        after=_resume_last,
    ),
    "checkpoint_best": dict(
        max_epochs=3,
        enable_checkpointing=True,
        callbacks=[cb.ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)],
        after=_best,
    ),
    "checkpoint_weights_only": dict(
        max_epochs=2,
        enable_checkpointing=True,
        after=_weights_only,
        callbacks=[cb.ModelCheckpoint(save_weights_only=True, save_last=True)],
    ),
    "validate_test_predict": dict(max_steps=3, after=_evaluate),
    # Validation (and ModelCheckpoint's save) after batches 3 and 9 falls inside a window of 2 micro-batches, where
    # stage 3 holds its units gathered (engine/stage3/fsdp2_window.py): both must see the sharded module, and training
    # goes on from the gradients accumulated before them.
    "validation_inside_accumulation_window": dict(
        max_epochs=1,
        accumulate_grad_batches=2,
        val_check_interval=3,
        limit_val_batches=2,
        enable_checkpointing=True,
        callbacks=[cb.ModelCheckpoint(monitor="val_loss", save_top_k=1)],
        after=_best,
    ),
}


def conformance(stages_by_feature: dict[str, list[str]], directory: Path) -> dict:
    """Each feature under ``ddp`` and the given ZeRO stages; each stage's weights compared with ``ddp``'s."""
    out = {}
    for feature, stages in stages_by_feature.items():
        spec = dict(FEATURES[feature])
        after, callbacks = spec.pop("after", None), spec.pop("callbacks", [])
        if spec.get("logger") is True:
            spec["logger"] = None  # set per run below
        runs = {}
        for name in ["ddp", *stages]:
            where = directory / feature / name
            kwargs = dict(spec)
            if "logger" in kwargs:
                kwargs["logger"], kwargs["log_every_n_steps"] = CSVLogger(where, name="logs"), 1
            runs[name] = _fit(name, where, callbacks=[_fresh(c) for c in callbacks], after=after, **kwargs)
        reference = {key: runs["ddp"].get(key) for key in ("weights", "resumed_weights")}
        for run in runs.values():
            for key in ("weights", "resumed_weights"):
                mine = run.pop(key, None)
                if mine is not None and reference[key] is not None and RANK == 0:
                    run[f"{key}_diff_vs_ddp"] = max_diff(mine, reference[key])
        out[feature] = runs
    return out


def _fresh(callback):
    """A new callback of the same configuration for each run (callbacks keep state)."""
    return copy.deepcopy(callback)


STAGES = ["zero1", "zero2", "zero3"]
#: `make test`'s features, each at the stages where it meets the most engine code: the loop (accumulation and
#: clipping; validation inside an accumulation window, where stage 3 holds its units gathered), a callback that
#: stops it, checkpoints and their best-model bookkeeping, the evaluation entry points, gradient norms as Lightning's
#: docs log them (stage 2 holds no `p.grad`, stage 3 DTensors), and a refusal (the same at every stage). The other stages of these, and the other features at every stage: `make test-all`.
REPRESENTATIVE = {
    "accumulate_clip": ["zero1", "zero3"],
    "grad_norm": ["zero2", "zero3"],
    "torch_clip_in_hook": ["zero3", "zero3_offload"],
    "ema": ["zero2_offload", "zero3"],
    "swa": ["zero2_offload"],
    "validation_inside_accumulation_window": ["zero2", "zero3"],
    "early_stopping": ["zero1"],
    "checkpoint_best": ["zero2", "zero3"],
    "validate_test_predict": ["zero3"],
    "batch_size_finder": ["zero2"],
}
#: Features that conform at stage 3 only (they edit ``p.grad``, which stages 1-2 do not hold whole).
STAGE3_ONLY = {"torch_clip_in_hook"}
REPRESENTATIVE_OTHER_STAGES = {
    feature: [s for s in STAGES if s not in stages]
    for feature, stages in REPRESENTATIVE.items()
    if feature not in STAGE3_ONLY
}
REST = {feature: STAGES for feature in FEATURES if feature not in REPRESENTATIVE}

CASES = {
    "representative": lambda directory: conformance(REPRESENTATIVE, directory),
    "rest": lambda directory: conformance({**REPRESENTATIVE_OTHER_STAGES, **REST}, directory),
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
