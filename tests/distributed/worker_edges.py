"""Rank program for full checkpoints, bad input and failing ranks (see ``worker_core.py`` for the pattern)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from torch import nn

from lightning_zero import ZeroPrecision, ZeroStrategy, load_from_checkpoint
from lightning_zero.checkpoint import state_dicts
from tests.distributed import memory_layouts, models
from tests.distributed.worker_checkpoint import RestoredProbe, optim_scale
from tests.distributed.worker_core import RANK, WORLD, max_diff, run_scale, trainer
from tests.launch import run_cases_with_directory


def full_checkpoint(save_stage: int, resume_stage: int, directory: Path) -> dict:
    """Train 4 steps at ``save_stage``, save a full checkpoint, resume at ``resume_stage`` for 2 more."""
    steps, accumulate, batch, clip = 4, 2, 4, 0.5
    L.seed_everything(7)
    module = models.Regression()
    initial = copy.deepcopy(module.state_dict())
    data = models.IndexedData()
    common = dict(accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    t = trainer(ZeroStrategy(stage=save_stage, state_dict_type="full"), max_steps=steps, **common)
    t.fit(module, models.loader(data, batch))
    path = directory / f"s{save_stage}.ckpt"
    t.save_checkpoint(path)
    out = {}
    if RANK == 0:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        ref_params, _, ref_optim = models.reference_run(
            initial, data, world=WORLD, batch=batch, steps=steps, accumulate=accumulate, clip=clip
        )
        out["keys_match"] = sorted(ckpt["state_dict"]) == sorted(ref_params)
        out["param_diff"] = max_diff(ckpt["state_dict"], ref_params)
        plain = models.Regression()
        plain.load_state_dict(ckpt["state_dict"])  # loads into a model that never saw ZeroStrategy
        saved = ckpt["optimizer_states"][0]
        out["optim_state_diff"] = max(
            (saved["state"][i][k] - ref_optim["state"][i][k]).abs().max().item()
            for i in ref_optim["state"]
            for k in ("exp_avg", "exp_avg_sq")
        )
        out["moment_scale"] = optim_scale(ref_optim)["moment_scale"]  # what its bound is derived from
        out["saved_steps"] = t.global_step
        out["optim_groups_match"] = [g["params"] for g in saved["param_groups"]] == [
            g["params"] for g in ref_optim["param_groups"]
        ]
        opt, _ = models.make_optimizer(plain)
        opt.load_state_dict(saved)  # and into a plain optimizer
    probe = RestoredProbe()
    t2 = trainer(
        ZeroStrategy(stage=resume_stage, state_dict_type="full"), max_steps=steps + 2, callbacks=[probe], **common
    )
    t2.fit(models.Regression(), models.loader(data, batch), ckpt_path=str(t.strategy.broadcast(str(path))))
    out["resumed_steps"] = t2.global_step
    if RANK == 0:
        out["restored_param_diff"] = max_diff(probe.params, ckpt["state_dict"])
        out["restored_optim_diff"] = max(
            (probe.optim["state"][i][k] - saved["state"][i][k]).abs().max().item()
            for i in saved["state"]
            for k in saved["state"][i]
        )
        out["restored_lr"] = [g["lr"] for g in probe.optim["param_groups"]]
        out["saved_lr"] = [g["lr"] for g in saved["param_groups"]]
    return out


def sharded_checkpoint(save_stage: int, resume_stage: int, directory: Path) -> dict:
    """The default format: a directory of shards written by every rank, read back at another stage."""
    L.seed_everything(7)
    data = models.IndexedData()
    common = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    t = trainer(ZeroStrategy(stage=save_stage), max_steps=4, **common)
    t.fit(models.Regression(), models.loader(data, 4))
    path = Path(t.strategy.broadcast(str(directory / f"sharded-s{save_stage}")))
    t.save_checkpoint(path)
    t.save_checkpoint(path)  # overwriting an existing checkpoint directory is atomic too
    full = t.strategy.full_state_dict()
    optim = state_dicts.full_optimizer_state(t.optimizers[0], t.lightning_module, t.strategy.engine)
    probe = RestoredProbe()
    t2 = trainer(ZeroStrategy(stage=resume_stage, state_dict_type="full"), max_steps=6, callbacks=[probe], **common)
    t2.fit(models.Regression(), models.loader(data, 4), ckpt_path=str(path))
    out = {"is_dir": path.is_dir(), "resumed_steps": t2.global_step}
    if RANK == 0:
        out["leftovers"] = sorted(p.name for p in path.parent.iterdir() if p.name.startswith("."))
        out["restored_param_diff"] = max_diff(probe.params, full)
        out["restored_optim_keys"] = sorted(probe.optim["state"][0])
        out["restored_optim_diff"] = max(
            (probe.optim["state"][i][k].float() - optim["state"][i][k].float()).abs().max().item()
            for i in optim["state"]
            for k in optim["state"][i]
        )
        out["restored_lr"] = [g["lr"] for g in probe.optim["param_groups"]]
        out["saved_lr"] = [g["lr"] for g in optim["param_groups"]]
        out["optim_entries"] = len(probe.optim["state"])
    return out


class LBFGSModule(models.Regression):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class FrozenModule(models.Regression):
    def __init__(self):
        super().__init__()
        self.requires_grad_(False)


class LazyModule(models.Regression):
    def __init__(self):
        super().__init__()
        self.extra = torch.nn.LazyLinear(4)


class CallsALayerOfAUnit(models.Regression):
    """Runs the first layer of a block (a stage-3 unit) on its own, outside the block's forward."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net.blocks[0][0](self.net.inp(x))
        return torch.nn.functional.mse_loss(h.sum(-1, keepdim=True).expand_as(y), y)


class PenaltyOnTheParameters(models.Regression):
    """An L2 penalty over ``self.parameters()`` added in ``training_step``: outside their units' forward the blocks'
    parameters are shards at stage 3."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-3 * sum(p.square().sum() for p in self.parameters())


class FailingModule(models.Regression):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            raise ValueError("boom from rank 1 at batch 2")
        return super().training_step(batch, batch_idx)


def expect_error(module_cls) -> dict:
    return expect_fit_error(module_cls, ZeroStrategy(stage=2), models.loader(models.IndexedData(), 4))


CASES = {
    "checkpoint": lambda directory: {
        "stage2_to_stage3": full_checkpoint(2, 3, directory),
        "stage3_to_stage1": full_checkpoint(3, 1, directory),
    },
    "sharded": lambda directory: {
        "stage2_to_stage3": sharded_checkpoint(2, 3, directory),
        "stage3_to_stage1": sharded_checkpoint(3, 1, directory),
    },
    "bad_input": lambda directory: {
        "lbfgs": expect_error(LBFGSModule),
        "frozen": expect_error(FrozenModule),
        "lazy": expect_error(LazyModule),
        "layer_of_a_unit": expect_fit_error(
            CallsALayerOfAUnit, ZeroStrategy(stage=3), models.loader(models.IndexedData(), 4)
        ),
        "penalty": expect_fit_error(
            PenaltyOnTheParameters, ZeroStrategy(stage=3), models.loader(models.IndexedData(), 4)
        ),
        "after_stage3": fit_again_after_stage_3(),
    },
    "rank_failure": lambda directory: {"unreachable": expect_error_free_failure()},
    "memory_layouts": lambda directory: trained_as_built(
        {
            "channels_last": (2, 3),
            "transposed": (1,),
            "fp64_head": (3,),
            "bf16_body": (2,),
            "sparse_sgd": (3,),
            "sparse_adagrad": (2,),
            "zero_dim": (2, 3),
        }
    ),
    "memory_layouts_rest": lambda directory: trained_as_built(
        {
            "channels_last": (1,),
            "transposed": (2, 3),
            "fp64_head": (1, 2),
            "bf16_body": (1, 3),
            "sparse_sgd": (1, 2),
            "sparse_adagrad": (1, 3),
            "zero_dim": (1,),
        }
    ),
    # the offloaded step (during backward, unclipped), and checkpoints across stages and formats
    "zero_dim": lambda directory: {
        **against_ddp(
            memory_layouts.Temperature, {"stage3_offload_unclipped": (dict(stage=3, offload_optimizer=True), None)}
        ),
        **resumed_against_ddp(memory_layouts.Temperature, directory, [(3, "sharded", 1), (2, "full", 3)]),
    },
    # host masters (fp32, so exactly as ddp) take in what code wrote into the parameters between steps, and so do
    # stage 3's shards what it wrote into the gathered copies of an accumulation window
    # the prototypes stay in the root's unit (`training_step` computes with their weight): written while gathered
    "written": lambda directory: {
        **against_ddp(
            memory_layouts.NormalisedPrototypes,
            {
                "stage2_offload": (dict(stage=2, offload_optimizer=True), 0.5),
                "stage3_offload": (dict(stage=3, offload_optimizer=True), 0.5),
                "stage1_offload_unclipped": (dict(stage=1, offload_optimizer=True), None),
                "stage3_offload_unclipped": (dict(stage=3, offload_optimizer=True), None),
            },
        ),
        **{
            f"teacher_{name}": result
            for name, result in against_ddp(
                memory_layouts.MomentumTeacher,
                {"stage3": (dict(stage=3), 0.5), "stage3_offload": (dict(stage=3, offload_optimizer=True), 0.5)},
            ).items()
        },
        # frozen parameters written while gathered, without accumulation windows (the root gathered in training_step)
        **{
            f"codebook_{name}": result
            for name, result in against_ddp(
                memory_layouts.EMACodebook,
                {"stage3": (dict(stage=3), 0.5), "stage3_offload_params": (dict(stage=3, offload_params=True), 0.5)},
                accumulate=1,
            ).items()
        },
    },
    "zero_dim_rest": lambda directory: {
        **against_ddp(
            memory_layouts.Temperature,
            {
                "stage2_offload_unclipped": (dict(stage=2, offload_optimizer=True), None),
                "stage3_offload_params": (dict(stage=3, offload_params=True), 0.5),
            },
        ),
        **resumed_against_ddp(
            memory_layouts.Temperature, directory, [(1, "sharded", 3), (3, "full", 2), (3, "sharded", 3)]
        ),
    },
    # complex parameters under bf16-mixed (held complex) and offloaded (torch's fused host kernels refuse them)
    "complex": lambda directory: {
        **{
            f"{name}_bf16": result
            for name, result in against_ddp(
                memory_layouts.FourierOperator,
                {
                    "stage1": (dict(stage=1), 0.5),
                    "stage2_offload": (dict(stage=2, offload_optimizer=True), 0.5),
                    "stage3": (dict(stage=3), 0.5),
                },
                precision="bf16-mixed",
            ).items()
        },
        **against_ddp(
            memory_layouts.FourierOperator,
            {  # clipped hard: the norm counts the imaginary parts
                "stage1_offload": (dict(stage=1, offload_optimizer=True), 0.01),
                "stage3_offload": (dict(stage=3, offload_optimizer=True), 0.01),
            },
        ),
    },
    # ModelPruning (lottery ticket: parameters given new storage), and its sharded checkpoints named as it writes them
    "pruning": lambda directory: {
        **against_ddp(
            memory_layouts.PrunedMLP,
            {"stage1": (dict(stage=1), 0.5), "stage2_half_offload": (dict(stage=2, offload_optimizer=0.5), 0.5)},
            callbacks=lambda: [ModelPruning("l1_unstructured", amount=0.3, verbose=0)],
        ),
        "stage2_sharded_mid_fit_to_stage1": pruned_resumed(directory),
        "stage3": expect_fit_error(
            memory_layouts.PrunedMLP, ZeroStrategy(stage=3), callbacks=[ModelPruning("l1_unstructured", amount=0.3)]
        ),
    },
    "functional_sparse": lambda directory: functional_sparse((1, 2, 3)),
    # a layer casting itself in forward under bf16-mixed: refused by name, trained once its class is listed fp32
    "changed_dtype": lambda directory: {
        **{
            f"stage{s}": expect_fit_error(memory_layouts.UndeclaredCast, ZeroStrategy(stage=s), precision="bf16-mixed")
            for s in (1, 2, 3)
        },
        **{
            f"stage{s}_listed": expect_fit_error(
                memory_layouts.UndeclaredCast,
                ZeroStrategy(stage=s),
                plugins=[ZeroPrecision("bf16-mixed", fp32_modules=(memory_layouts.CastsItself,))],
            )
            for s in (1, 2, 3)
        },
    },
    # the block a unit of its own (reduced once per run), and the host step during backward (no clipping)
    "shared_block": lambda directory: against_ddp(
        memory_layouts.SharedBlock,
        {
            "stage3": (dict(stage=3, wrap_policy={torch.nn.Sequential}), 0.5),
            "stage3_offload_unclipped": (
                dict(stage=3, wrap_policy={torch.nn.Sequential}, offload_optimizer=True),
                None,
            ),
        },
    ),
    # blocks run as `block.forward(h)`, an autoencoder through its methods: their layers become the units, by default
    # and under a policy naming them
    "outside_hooks": lambda directory: {
        **against_ddp(
            memory_layouts.DirectForwardBlocks,
            {
                "stage3": (dict(stage=3), 0.5),
                "stage3_policy_checkpointed": (
                    dict(
                        stage=3,
                        wrap_policy={memory_layouts.GatedResidual},
                        activation_checkpointing={memory_layouts.GatedResidual},
                    ),
                    0.5,
                ),
                "stage2": (dict(stage=2), 0.5),
            },
        ),
        **{
            f"aliased_{name}": result
            for name, result in against_ddp(
                memory_layouts.AliasedForwardBlocks,
                {
                    "stage3": (dict(stage=3), 0.5),
                    "stage3_policy": (dict(stage=3, wrap_policy={memory_layouts.GatedResidual}), 0.5),
                },
            ).items()
        },
        **{
            f"read_{name}": result
            for name, result in against_ddp(
                memory_layouts.TiedHeadReadDirectly,
                {"stage3": (dict(stage=3), 0.5), "stage3_offload_params": (dict(stage=3, offload_params=True), 0.5)},
                accumulate=1,
            ).items()
        },
        **{
            f"attention_{name}": result
            for name, result in against_ddp(
                memory_layouts.Attention,
                {"stage3_linear_units": (dict(stage=3, wrap_policy={nn.Linear}), 0.5)},
                accumulate=1,
            ).items()
        },
        **{
            f"autoencoder_{name}": result
            for name, result in against_ddp(
                memory_layouts.Reconstruction,
                {"stage3": (dict(stage=3), 0.5), "stage3_offload_params": (dict(stage=3, offload_params=True), 0.5)},
            ).items()
        },
    },
    # integer parameters kept whole at stage 3; the class FSDP2 gave the module taken back to the user's by loading
    "integer": lambda directory: {
        **against_ddp(
            memory_layouts.QuantizedBase,
            {"stage3": (dict(stage=3), 0.5), "stage3_offload_params": (dict(stage=3, offload_params=True), 0.5)},
        ),
        **resumed_against_ddp(memory_layouts.QuantizedBase, directory, [(3, "sharded", 2)]),
        "loaded_by_the_sharded_class": loaded_by_the_sharded_class(directory),
        **{
            f"meta_{name}": result
            for name, result in against_ddp(
                lambda: memory_layouts.QuantizedBase("layers"), {"stage3": (dict(stage=3), 0.5)}
            ).items()
        },
    },
    "integer_unset": lambda directory: expect_fit_error(
        lambda: memory_layouts.QuantizedBase("table"), ZeroStrategy(stage=3)
    ),
    "parameter_functions": lambda directory: {
        **against_ddp(models.MovedWeightsConsistency, {"stage1": (dict(stage=1), 0.5), "stage2": (dict(stage=2), 0.5)}),
        "stage3": expect_fit_error(models.MovedWeightsConsistency, ZeroStrategy(stage=3)),
        **{
            f"grad_{k}": v for k, v in against_ddp(models.GradientNormPenalty, {"stage2": (dict(stage=2), 0.5)}).items()
        },
        "grad_stage3": expect_fit_error(models.GradientNormPenalty, ZeroStrategy(stage=3)),
    },
    "shared_block_rest": lambda directory: against_ddp(
        memory_layouts.SharedBlock,
        {
            "stage3_merged": (dict(stage=3), 0.5),
            "stage3_offload_params": (dict(stage=3, offload_params=True), 0.5),
            "stage2_offload_unclipped": (dict(stage=2, offload_optimizer=True), None),
        },
    ),
}


def fit_again_after_stage_3() -> dict:
    """A module fit at stage 3 (sharded in place), then fit again: at stage 2 (refused, naming the way out) and at
    stage 3 (continues)."""
    module, data = models.Regression(), models.loader(models.IndexedData(), 4)
    trainer(ZeroStrategy(stage=3), max_steps=2).fit(module, data)
    out = {}
    try:
        trainer(ZeroStrategy(stage=2), max_steps=2).fit(module, data)
        out["stage2"] = {"type": None}
    except Exception as err:  # the behaviour under test: a clear error, on every rank, no hang
        out["stage2"] = {"type": type(err).__name__, "message": str(err)}
    again = trainer(ZeroStrategy(stage=3), max_steps=2)
    again.fit(module, data)
    out["stage3"] = {"steps": again.global_step}
    return out


def trained_as_built(layouts: dict[str, tuple[int, ...]]) -> dict:
    """Each model of ``memory_layouts.MODELS`` under ``ddp`` and the given stages, 4 steps with accumulation 2 (and
    clipping, but for sparse gradients, which Lightning's ``ddp`` cannot clip): the weights against ``ddp``'s, and the
    embeddings' ``sparse`` flags after ``fit``."""
    out: dict[str, dict] = {}
    for name, stages in layouts.items():
        clip = None if name.startswith("sparse") else 0.5
        weights = {}
        for stage in (0, *stages):
            L.seed_everything(3)
            module = memory_layouts.MODELS[name]()
            t = trainer(
                ZeroStrategy(stage=stage) if stage else "ddp",
                max_steps=4,
                accumulate_grad_batches=2,
                gradient_clip_val=clip,
            )
            t.fit(module)
            weights[stage] = (
                t.strategy.full_state_dict()
                if stage
                else {k: v.detach().clone() for k, v in module.state_dict().items()}
            )
            if stage:
                out[f"{name}/stage{stage}"] = {
                    "sparse_after_fit": [
                        m.sparse for m in module.modules() if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag)
                    ],
                    **(versus_ddp(weights[stage], weights[0], t) if RANK == 0 else {}),
                }
    return out


def against_ddp(
    model: Callable[[], L.LightningModule],
    settings: dict[str, tuple[dict, float | None]],
    precision: str = "32-true",
    callbacks: Callable[[], list[L.Callback]] = list,
    accumulate: int = 2,
) -> dict:
    """``model`` under ``ddp`` and under each ZeroStrategy setting (keyword arguments, clipping), 4 steps with
    accumulation ``accumulate`` (``precision`` and fresh ``callbacks`` in every run): the weights against ``ddp``'s
    with the same clipping."""
    out, reference = {}, {}
    for name, (kwargs, clip) in settings.items():
        for strategy in ("ddp", name):
            if strategy == "ddp" and clip in reference:
                continue
            L.seed_everything(3)
            module = model()
            zero = strategy != "ddp"
            t = trainer(
                ZeroStrategy(**kwargs) if zero else "ddp",
                max_steps=4,
                accumulate_grad_batches=accumulate,
                gradient_clip_val=clip,
                precision=precision,
                callbacks=callbacks(),
            )
            t.fit(module)
            weights = (
                t.strategy.full_state_dict()
                if zero
                else {k: v.detach().clone() for k, v in module.state_dict().items()}
            )
            if not zero:
                reference[clip] = weights
            elif RANK == 0:
                out[name] = versus_ddp(weights, reference[clip], t)
    return out


def versus_ddp(weights: dict, reference: dict, fitted: L.Trainer) -> dict:
    """The weights' distance from ``ddp``'s, with what its bound is derived from (``tests/tolerances.py``,
    ``worker_core.run_scale``)."""
    return {"diff_vs_ddp": max_diff(weights, reference), **run_scale(fitted)}


def resumed_against_ddp(
    model: Callable[[], L.LightningModule], directory: Path, runs: list[tuple[int, str, int]]
) -> dict:
    """For each (stage, checkpoint format, stage resumed at): ``model`` trained an epoch (2 steps, accumulation 2,
    clipping) and saved, then resumed for a second epoch in a new process's worth of objects: the weights against
    ``ddp``'s two epochs."""

    def fit(strategy, epochs: int, module: L.LightningModule, ckpt_path: Path | None = None) -> L.Trainer:
        t = trainer(strategy, max_epochs=epochs, accumulate_grad_batches=2, gradient_clip_val=0.5)
        t.fit(module, ckpt_path=ckpt_path)
        return t

    L.seed_everything(3)
    reference = fit("ddp", 2, model()).lightning_module.state_dict()
    out = {}
    for stage, kind, resumed in runs:
        L.seed_everything(3)
        path = directory / f"{stage}_{kind}_{resumed}{'' if kind == 'sharded' else '.ckpt'}"
        fit(ZeroStrategy(stage=stage, state_dict_type=kind), 1, model()).save_checkpoint(path)
        t = fit(ZeroStrategy(stage=resumed), 2, model(), ckpt_path=path)
        weights = t.strategy.full_state_dict()
        if RANK == 0:
            out[f"stage{stage}_{kind}_to_stage{resumed}"] = versus_ddp(weights, reference, t)
    return out


def loaded_by_the_sharded_class(directory: Path) -> float:
    """A stage-3 fit's sharded checkpoint loaded by ``type(model)`` after the fit (FSDP2's ``FSDPQuantizedBase``):
    the weights against the fit's own."""
    L.seed_everything(3)
    t = trainer(ZeroStrategy(stage=3), max_steps=2)
    t.fit(memory_layouts.QuantizedBase())
    t.save_checkpoint(directory / "by_class")
    weights = t.strategy.full_state_dict()
    if RANK != 0:
        return 0.0
    loaded = load_from_checkpoint(type(t.lightning_module), directory / "by_class")
    assert type(loaded) is memory_layouts.QuantizedBase, type(loaded)
    assert loaded.blocks[0].qweight.dtype == torch.int8
    return max_diff(loaded.state_dict(), weights)


def pruned_resumed(directory: Path) -> dict:
    """``PrunedMLP`` saved by ``ModelCheckpoint`` after its first epoch's pruning (optimizer state of ``<name>_orig``
    parameters beside ``ModelPruning``'s permanent ``<name>`` weights) at stage 2 in sharded form, resumed at stage 1
    for a third epoch: the weights against ``ddp`` doing the same through a full file."""

    def fit(strategy, epochs: int, saved: Path | None = None, ckpt_path: str | None = None) -> L.Trainer:
        L.seed_everything(3)
        callbacks = [ModelPruning("l1_unstructured", amount=0.3, verbose=0)]
        if saved is not None:
            callbacks.append(ModelCheckpoint(dirpath=saved, filename="{epoch}", save_top_k=-1))
        t = trainer(
            strategy,
            max_epochs=epochs,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
            callbacks=callbacks,
            enable_checkpointing=saved is not None,
        )
        t.fit(memory_layouts.PrunedMLP(), ckpt_path=ckpt_path)
        return t

    def first_epoch(t: L.Trainer) -> str:  # in rank 0's directory, which ModelCheckpoint broadcasts
        return f"{t.checkpoint_callback.dirpath}/epoch=0.ckpt"

    reference = fit(
        "ddp", 3, ckpt_path=first_epoch(fit("ddp", 2, directory / "pruned_ddp"))
    ).lightning_module.state_dict()
    saved = fit(ZeroStrategy(stage=2, state_dict_type="sharded"), 2, directory / "pruned_zero")
    resumed = fit(ZeroStrategy(stage=1), 3, ckpt_path=first_epoch(saved))
    weights = resumed.strategy.full_state_dict()
    return versus_ddp(weights, reference, resumed) if RANK == 0 else {}


def expect_fit_error(model: Callable[[], L.LightningModule], strategy: ZeroStrategy, *data, **kwargs) -> dict:
    """What a 2-step ``fit`` of ``model()`` (on ``data``, or its own loader) raises, if anything."""
    try:
        trainer(strategy, max_steps=2, **kwargs).fit(model(), *data)
    except Exception as err:  # the behaviour under test: a clear error, on every rank, no hang
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None}


def functional_sparse(stages: tuple[int, ...]) -> dict:
    """``F.embedding(..., sparse=True)`` in ``forward``: what each stage raises."""
    return {
        f"stage{stage}": expect_fit_error(memory_layouts.FunctionalSparse, ZeroStrategy(stage=stage))
        for stage in stages
    }


def expect_error_free_failure() -> dict:
    trainer(ZeroStrategy(stage=2), max_steps=6).fit(FailingModule(), models.loader(models.IndexedData(), 4))
    return {}


if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
