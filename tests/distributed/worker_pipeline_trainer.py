"""Rank program for tests/distributed/test_pipeline_trainer.py: ``ZeroStrategy(pipeline_stages=2)`` inside
``lightning.Trainer`` against plain single-process PyTorch on the same global batches (``pipeline_chain.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.engine.comm import collectives
from lightning_zero.planning.accounting import model_state_bytes
from tests.distributed import models
from tests.distributed.grad_norm_probe import GradNormAgainstGathered
from tests.distributed.pipeline_chain import (
    ACCUMULATE,
    CLIP,
    STEPS_PER_EPOCH,
    Chain,
    held_parameters,
    initial_state,
    loader,
    reference,
    routed_samples,
    val_loader,
)
from tests.distributed.worker_core import GradientRecorder, max_diff, trainer
from tests.launch import run_cases_with_directory

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


class LoggedLosses(L.Callback):
    """What ``self.log("train_loss", ...)`` showed after every batch, and the model state right after the
    last backward, on this rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.state_bytes = 0

    def on_after_backward(self, trainer, pl_module):
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        self.state_bytes = model_state_bytes(pl_module, optimizers, trainer.strategy.engine)["device"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class SentElements(L.Callback):
    """Elements this rank sent point-to-point (``comm_stats()["send"]``) in each training batch, and its size."""

    def __init__(self) -> None:
        self.per_batch: list[tuple[int, int]] = []
        self._before = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = collectives.comm_stats().snapshot()["elements_by_kind"].get("send", 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sent = collectives.comm_stats().snapshot()["elements_by_kind"].get("send", 0) - self._before
        self.per_batch.append((sent, batch[0].shape[0]))


def fit(
    strategy: ZeroStrategy, replicas: int, epochs: int, ckpt_path=None, module=None, **kwargs
) -> tuple[L.Trainer, Chain]:
    module = module or Chain()
    if ckpt_path is None:
        module.load_state_dict(initial_state(module.routed))
    settings = dict(
        max_epochs=epochs,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        limit_val_batches=2,
        check_val_every_n_epoch=1,
        callbacks=[LoggedLosses()],
    )
    t = trainer(strategy, **{**settings, **kwargs})
    t.fit(module, loader(replicas), val_loader(replicas), ckpt_path=ckpt_path)
    return t, module


def exactness(
    stage: int,
    schedule: str,
    split="layers",
    microbatches: int = 4,
    routed: bool = False,
    strategy_kwargs: dict | None = None,
    **kwargs,
) -> dict:
    replicas = WORLD // 2
    strategy = ZeroStrategy(
        stage=stage,
        pipeline_stages=2,
        microbatches=microbatches,
        pipeline_schedule=schedule,
        pipeline_split=split,
        **(strategy_kwargs or {}),
    )
    recorder = GradientRecorder()  # strategy.gather_gradients(): every stage's, reduced over the replicas
    sent = SentElements()
    t, module = fit(
        strategy, replicas, epochs=1, callbacks=[LoggedLosses(), recorder, sent], module=Chain(routed), **kwargs
    )
    full = t.strategy.full_state_dict()  # every stage's parameters, on rank 0
    params = held_parameters(module)
    expected_grads: list[dict] = []
    expected, losses, val_loss = reference(STEPS_PER_EPOCH, expected_grads, routed)
    logged = collectives.all_gather_objects(
        {"train_losses": t.callbacks[0].losses, "val_loss": float(t.callback_metrics["val_loss"])}
    )
    held = collectives.all_gather_objects(sorted(n for n, p in module.named_parameters() if not p.is_meta))
    memory = collectives.all_gather_objects(
        (
            t.callbacks[0].state_bytes,
            sum(p.numel() for p in module.parameters() if not p.is_meta),
            sum(1 for p in module.parameters() if not p.is_meta),
        )
    )
    return {
        "steps": t.global_step,
        "param_diff": max_diff(params, expected),
        "full_state_dict_diff": max_diff(full, expected) if RANK == 0 else None,
        "grad_diff": max(max_diff(g, r) for g, r in zip(recorder.steps, expected_grads)),
        "grad_steps": len(recorder.steps),
        "param_change": max_diff(expected, initial_state(routed)),
        "routed_samples": routed_samples(STEPS_PER_EPOCH) if routed else None,
        "rare_change": float(
            (expected["layers.0.rare.weight"] - initial_state(True)["layers.0.rare.weight"]).abs().max()
        )
        if routed
        else None,
        "logged": logged,
        "reference_train_losses": losses,
        "reference_val_loss": val_loss,
        "held": held,
        "memory": memory,  # per rank: (model-state bytes after backward, parameters held, parameter tensors held)
        "stage": stage,
        "names": sorted(expected),
        "bounds": t.strategy.pipeline.bounds,
        "cross_cuts": _cross_cuts(t.strategy.pipeline.layout),
        "layout": "v" if t.strategy.pipeline.layout.v_shape else "looped",
        "engine_world": t.strategy.engine.world_size,
        "sent": collectives.all_gather_objects(sent.per_batch),
        "offloaded": collectives.all_gather_objects(
            vars(t.strategy.activation_offload.statistics) if t.strategy.activation_offload is not None else None
        ),
    }


class GatheredPeak(L.Callback):
    """Per training batch on this rank: all-gathered elements, and the most parameter elements FSDP2 held
    gathered at any forward of a stage's layer (stage 3 under pipeline stages)."""

    def __init__(self) -> None:
        self.gathered: list[int] = []
        self.peak = 0
        self._before = 0

    def on_fit_start(self, trainer, pl_module):
        from lightning_zero.engine.stage3 import fsdp2_private

        groups = [g for m in trainer.strategy.pipeline.runner.modules for g in fsdp2_private.param_groups(m)]

        def probe(*_):
            held = sum(
                fp._orig_size.numel() for g in groups for fp in g.fsdp_params if fp.sharded_state.name == "UNSHARDED"
            )
            self.peak = max(self.peak, held)

        for module in trainer.strategy.pipeline.runner.modules:
            for layer in module:
                layer.register_forward_pre_hook(probe)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = collectives.comm_stats().snapshot()["elements_by_kind"].get("all_gather", 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.gathered.append(
            collectives.comm_stats().snapshot()["elements_by_kind"].get("all_gather", 0) - self._before
        )


def gathers(schedule: str) -> dict:
    """Stage 3: the parameter elements each rank all-gathers per training batch, and the most it holds gathered."""
    probe = GatheredPeak()
    strategy = ZeroStrategy(stage=3, pipeline_stages=2, microbatches=4, pipeline_schedule=schedule)
    fit(strategy, WORLD // 2, epochs=1, callbacks=[LoggedLosses(), probe], limit_val_batches=0)
    return {
        "gathered": collectives.all_gather_objects(probe.gathered),
        "peak": collectives.all_gather_objects(probe.peak),
        "params": collectives.all_gather_objects(
            sum(p.numel() for p in strategy.lightning_module.parameters() if not p.is_meta)
        ),
    }


def _cross_cuts(layout) -> int:
    """Cuts between stages on different ranks (a V's turn stays on one rank)."""
    return sum(layout.rank_of_stage(s) != layout.rank_of_stage(s + 1) for s in range(layout.num_stages - 1))


#: 16-mixed's first loss scale: low enough that no batch order overflows the first step (at 2**16 the first step
#: of some orders overflows, as dynamic loss scaling allows, and is skipped), high enough that no gradient underflows.
INITIAL_SCALE = 2.0**10


def mixed_precision() -> dict:
    """bf16-mixed and (through the plugin, on CPU) 16-mixed with loss scaling: close to the fp32 reference."""
    from lightning_zero import ZeroPrecision

    expected = reference(STEPS_PER_EPOCH)[0]
    out = {}
    for name, kwargs in (
        ("bf16-mixed", {"precision": "bf16-mixed"}),
        ("16-mixed", {"plugins": [ZeroPrecision("16-mixed", initial_scale=INITIAL_SCALE)]}),
    ):
        t, module = fit(ZeroStrategy(stage=2, pipeline_stages=2, microbatches=4), WORLD // 2, epochs=1, **kwargs)
        params = held_parameters(module)
        out[name] = {
            "param_diff": max_diff({k: v.float() for k, v in params.items()}, expected),
            "dtypes": sorted({str(p.dtype) for p in module.parameters() if not p.is_meta}),
            "losses": t.callbacks[0].losses,
            "loss_scale": t.strategy.precision_plugin.loss_scale,
        }
    return out


def checkpoint_round_trip(directory: Path) -> dict:
    """Pipelined -> plain ZeRO-2 on 2 ranks -> pipelined again, resuming (optimizer, scheduler, epoch) each
    time; each leg against the uninterrupted reference."""
    t, module = fit(ZeroStrategy(stage=1, pipeline_stages=2, microbatches=4), WORLD // 2, epochs=1)
    directory = Path(collectives.broadcast_object(str(directory)))  # the Trainer has made the process group
    piped_ckpt, plain_ckpt = directory / "piped.ckpt", directory / "plain.ckpt"
    t.save_checkpoint(piped_ckpt)
    saved_names = sorted(k[len("state_dict.") :] for k in _checkpoint_keys(piped_ckpt) if k.startswith("state_dict."))

    t, module = fit(ZeroStrategy(stage=2), WORLD, epochs=2, ckpt_path=piped_ckpt, module=Chain())
    plain = t.strategy.full_state_dict()
    plain_names = sorted(n for n, _ in module.named_parameters())
    t.save_checkpoint(plain_ckpt)

    t, module = fit(
        ZeroStrategy(stage=2, pipeline_stages=2, microbatches=2, pipeline_schedule="gpipe"),
        WORLD // 2,
        epochs=3,
        ckpt_path=plain_ckpt,
        module=Chain(),
    )
    piped_again = held_parameters(module)
    out = {"saved_names": saved_names, "plain_names": plain_names, "steps": t.global_step}
    if RANK == 0:
        out["plain_diff"] = max_diff(plain, reference(2 * STEPS_PER_EPOCH)[0])
        out["piped_again_diff"] = max_diff(piped_again, reference(3 * STEPS_PER_EPOCH)[0])
    return out


def zero3_round_trip(directory: Path) -> dict:
    """Pipeline x ZeRO-3 -> flat ZeRO-3 -> pipeline x ZeRO-3 (another schedule) -> flat ZeRO-1, each leg one more
    epoch resumed from the last one's sharded checkpoint (optimizer, scheduler, epoch), each against the
    uninterrupted reference: the flat legs shard over all the ranks, the pipelined ones over a stage's replicas."""
    legs = (
        (lambda: ZeroStrategy(stage=3, pipeline_stages=2, microbatches=4), WORLD // 2),
        (lambda: ZeroStrategy(stage=3), WORLD),
        (lambda: ZeroStrategy(stage=3, pipeline_stages=2, microbatches=2, pipeline_schedule="zbv"), WORLD // 2),
        (lambda: ZeroStrategy(stage=1), WORLD),
    )
    diffs, ckpt = [], None
    for epochs, (strategy, replicas) in enumerate(legs, start=1):
        t, module = fit(strategy(), replicas, epochs=epochs, ckpt_path=ckpt, module=Chain())
        params = held_parameters(module)
        diffs.append(max_diff(params, reference(epochs * STEPS_PER_EPOCH)[0]))
        if epochs == 1:  # the Trainer has made the process group
            directory = Path(collectives.broadcast_object(str(directory)))
        ckpt = directory / f"zero3_leg{epochs}.ckpt"
        t.save_checkpoint(ckpt)
    return {"diffs": diffs, "steps": t.global_step}


def zero3_composed() -> dict:
    """Pipeline x ZeRO-3 with what stage 3 composes with: offloaded optimizer (exact), activation checkpointing
    of every Linear, its inputs on the device or the host (exact), and bf16-mixed (close)."""
    from torch.distributed.tensor import DTensor

    expected = reference(STEPS_PER_EPOCH)[0]
    out = {}
    for name, kwargs, trainer_kwargs in (
        ("offload_optimizer", {"offload_optimizer": True}, {}),
        ("activation_checkpointing", {"activation_checkpointing": {nn.Linear}}, {}),
        ("offload_activations", {"activation_checkpointing": {nn.Linear}, "offload_activations": True}, {}),
        ("bf16-mixed", {}, {"precision": "bf16-mixed"}),
    ):
        strategy = ZeroStrategy(stage=3, pipeline_stages=2, microbatches=4, **kwargs)
        # grad_norm's stages and replicas, beside a run without offload (a hook keeps an offloaded step whole)
        check = GradNormAgainstGathered() if "offload_optimizer" not in kwargs else None
        if check is not None:
            trainer_kwargs = {**trainer_kwargs, "callbacks": [LoggedLosses(), check]}
        t, module = fit(strategy, WORLD // 2, epochs=1, **trainer_kwargs)
        params = held_parameters(module)
        out[name] = {
            "param_diff": max_diff({k: v.float() for k, v in params.items()}, expected),
            "steps": t.global_step,
            "sharded": all(isinstance(p, DTensor) for p in module.parameters() if not p.is_meta),
            "grad_norms": check.report() if check is not None else None,
        }
    return out


def evaluated_after_fit(directory: Path) -> dict:
    """Pipeline x ZeRO-3: ``validate`` after ``fit`` (the stage modules FSDP2 made roots of are the ones evaluated),
    a checkpoint after it equal to the one saved right after the fit (optimizer state included), then ``fit`` again
    on the same Trainer and module."""
    t, module = fit(ZeroStrategy(stage=3, pipeline_stages=2, microbatches=4), WORLD // 2, epochs=1)
    directory = Path(collectives.broadcast_object(str(directory)))
    t.save_checkpoint(directory / "fitted")
    validated = t.validate(module, val_loader(WORLD // 2), verbose=False)[0]["val_loss"]
    t.save_checkpoint(directory / "validated")
    t.fit_loop.max_epochs = 2
    t.fit(module, loader(WORLD // 2), val_loader(WORLD // 2))
    out = {"val_loss": validated, "reference_val_loss": reference(STEPS_PER_EPOCH)[2], "steps": t.global_step}
    if RANK == 0:
        out["checkpoints"] = models.compare_saved(directory / "fitted", directory / "validated")
    return out


def _checkpoint_keys(path: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(path).read_metadata().state_dict_metadata)


def errors(directory: Path) -> dict:
    """Bad pipelines fail with a clear error on every rank, and the process group lives on for the next case."""
    out = {}

    class Tiny(Chain):
        def pipeline_layers(self):
            return [self.layers[0]]  # one layer for two stages

    class NoLoss(Chain):
        pipeline_loss = None

    class Manual(Chain):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    manual = {"gradient_clip_val": None, "accumulate_grad_batches": 1}  # Lightning's own rules for manual optimization
    for name, module, kwargs, trainer_kwargs in (
        ("stages_over_layers", Tiny(), {}, {}),
        ("no_loss_hook", NoLoss(), {}, {}),
        ("microbatches", Chain(), {"microbatches": 3}, {}),
        ("manual_optimization", Manual(), {}, manual),
    ):
        try:
            fit(
                ZeroStrategy(stage=1, pipeline_stages=2, **kwargs),
                WORLD // 2,
                epochs=1,
                module=module,
                **trainer_kwargs,
            )
            out[name] = None
        except ZeroConfigError as err:
            out[name] = str(err)
    everywhere = collectives.all_gather_objects(out)
    return {**out, "same_on_every_rank": all(o == out for o in everywhere)}


#: The exactness matrix: every schedule at every ZeRO stage.
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
MATRIX = {f"{schedule}@{stage}": (schedule, stage) for schedule in SCHEDULES for stage in (1, 2, 3)}


def cases() -> dict:
    return {
        **{name: (lambda d, s=schedule, z=stage: exactness(z, s)) for name, (schedule, stage) in MATRIX.items()},
        "gpipe": lambda d: exactness(1, "gpipe"),
        # with Lightning's sanity check: evaluation schedules before the first training one
        "1f1b": lambda d: exactness(2, "1f1b", split="params", num_sanity_val_steps=2),
        "interleaved": lambda d: exactness(1, "interleaved_1f1b", microbatches=4),
        "gpipe_stage2": lambda d: exactness(2, "gpipe", split=["4"], microbatches=2),  # cut before the child "4"
        # every Linear checkpointed, the inputs that require grad (all but the first layer's) on the host
        "1f1b_offloaded_activations": lambda d: exactness(
            1, "1f1b", strategy_kwargs={"activation_checkpointing": {nn.Linear}, "offload_activations": True}
        ),
        # an expert used in a window's first micro-batch and by no rank in its second, each micro-batch reduced
        "routed_every_microbatch": lambda d: exactness(
            3, "gpipe", microbatches=2, routed=True, strategy_kwargs={"reduce_every_microbatch": True}
        ),
        "round_trip": checkpoint_round_trip,
        "zero3_round_trip": zero3_round_trip,
        "zero3_composed": lambda d: zero3_composed(),
        "gathers_1f1b": lambda d: gathers("1f1b"),
        "gathers_zbv": lambda d: gathers("zbv"),
        "mixed": lambda d: mixed_precision(),
        "errors": errors,
        "evaluated_after_fit": evaluated_after_fit,
    }


if __name__ == "__main__":
    run_cases_with_directory(cases(), sys.argv[1:])
