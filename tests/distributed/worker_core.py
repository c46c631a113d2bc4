"""Rank program for the core distributed tests: many Trainer runs in one process group.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_core GROUP``); rank 0 writes a JSON report
of measured values, and the pytest modules assert on it.
"""

from __future__ import annotations

import copy
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zero import ZeroStrategy
from lightning_zero.engine import shard
from lightning_zero.engine.comm.collectives import comm_stats
from lightning_zero.planning.accounting import live_tensor_bytes
from tests.distributed import models
from tests.launch import run_cases

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
NODES = int(os.environ.get("LZ_NODES", "1"))  # simulated nodes (tests/launch.py `nodes=`)


def trainer(strategy, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=WORLD // NODES,
        num_nodes=NODES,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def max_diff(a: dict, b: dict) -> float:
    common = set(a) & set(b)
    if set(a) != set(b):
        raise KeyError(
            f"name mismatch: only in run {sorted(set(a) - common)}, only in reference {sorted(set(b) - common)}"
        )
    return max((_wide(a[k]) - _wide(b[k])).abs().max().item() for k in common)


def run_scale(fitted: L.Trainer) -> dict:
    """What a reordered-fp32 bound on the run's weights is derived from (``tests/tolerances.py``): the largest
    learning rate its param groups started at (or hold: SWA or the tuner may set a larger one), over ``1 - momentum``
    for SGD with momentum (whose velocity sums the gradients of that many steps), and its optimizer steps."""
    lr = max(
        max(group.get("initial_lr", 0.0), group["lr"]) / (1 - group.get("momentum", 0.0))
        for optimizer in fitted.optimizers
        for group in optimizer.param_groups
    )
    return {"lr": lr, "steps": fitted.global_step}


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.complex128) if tensor.is_complex() else tensor.double()  # .double() drops imaginary parts


class GradientRecorder(L.Callback):
    """Full gradients by name at every optimizer step, before clipping (collective on every rank)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append({k: v.clone() for k, v in trainer.strategy.gather_gradients(optimizer).items()})


# ---------------------------------------------------------------------- cases
def exactness(
    stage,
    strategy=None,
    build_in_configure_model=False,
    bucket_size_mb=25.0,
    clip_algorithm="norm",
    unused_head=False,
    routed=False,
    penalty=0.0,
    validate_first=False,
    reversible=False,
) -> dict:
    steps, accumulate, batch = 4, 2, 4
    clip = 0.5 if clip_algorithm == "norm" else 0.05
    L.seed_everything(7)
    built = models.ValidatedRegression if validate_first else models.Regression
    module = built(
        build_in_configure_model=build_in_configure_model,
        unused_head=unused_head,
        routed=routed,
        penalty=penalty,
        reversible=reversible,
    )
    initial = None if build_in_configure_model else copy.deepcopy(module.state_dict())
    recorder = GradientRecorder()
    strategy = strategy or ZeroStrategy(stage=stage, bucket_size_mb=bucket_size_mb, state_dict_type="full")
    t = trainer(
        strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=clip_algorithm,
        callbacks=[recorder],
        **(dict(num_sanity_val_steps=1, limit_val_batches=1) if validate_first else {}),
    )
    data = models.IndexedData()
    t.fit(module, models.loader(data, batch), models.loader(data, batch) if validate_first else None)
    final = t.strategy.full_state_dict()
    out = {"steps": t.global_step}
    if stage == 3:  # the layers and the fully_shard calls they went into (see [Note: merged units])
        out["units"], out["unit_groups"] = len(t.strategy.engine.units), len(t.strategy.engine.unit_groups)
    if build_in_configure_model:
        # The values an eager build would have drawn from the same RNG state on rank 0.
        state = torch.get_rng_state()
        torch.set_rng_state(module.init_rng_state)
        eager = models.Regression()
        torch.set_rng_state(state)
        initial = {k: v.clone() for k, v in eager.state_dict().items()}
        out["dtensor_params"] = all(isinstance(p, DTensor) for p in module.parameters())  # stage 3 only
        out["local_numel"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
        out["full_numel"] = sum(p.numel() for p in module.parameters())
    if RANK == 0:
        ref_params, ref_grads, _ = models.reference_run(
            initial,
            data,
            world=WORLD,
            batch=batch,
            steps=steps,
            accumulate=accumulate,
            clip=clip,
            clip_algorithm=clip_algorithm,
            unused_head=unused_head,
            routed=routed,
            penalty=penalty,
            reversible=reversible,
        )
        out["param_diff"] = max_diff({k: v for k, v in final.items()}, ref_params)
        out["grad_diff"] = max(max_diff(g, r) for g, r in zip(recorder.steps, ref_grads))
        out["grad_steps"] = len(recorder.steps)
        out["param_change"] = max_diff(ref_params, initial)
        if routed:  # the experts each rank's micro-batches picked, and the one never picked
            micro = models.global_microbatches(data, WORLD, batch, steps * accumulate)
            routes = [[models.RoutedExperts.route(x) for x, _ in ranks] for ranks in micro]
            out["routes_differ"] = sum(len(set(r)) > 1 for r in routes)
            out["never_picked_unchanged"] = max_diff(
                {k: final[k] for k in final if ".experts.2." in k},
                {k: initial[k] for k in initial if ".experts.2." in k},
            )
    return out


def manual_two_optimizers(stage, model=models.TwoPlayer, **options) -> dict:
    L.seed_everything(11)
    module = model()
    initial = copy.deepcopy(module.state_dict())
    t = trainer(ZeroStrategy(stage=stage, state_dict_type="full", **options), max_steps=6)
    data = models.IndexedData()
    t.fit(module, models.loader(data, 4))
    final = t.strategy.full_state_dict()
    out = {"steps": t.global_step}
    if RANK == 0:
        ref = models.two_player_reference(initial, data, world=WORLD, batch=4, steps=3, clamp=module.clamp)
        out["param_diff"] = max_diff(final, ref)
    return out


def sharpness_aware(stage: int, model: type[L.LightningModule] = models.SharpnessAware, **options) -> dict:
    """Three SAM steps (``model``) at ``stage`` (``options``: more settings) against the same under Lightning's
    ``ddp``."""
    finals = []
    for strategy in (ZeroStrategy(stage=stage, **options), "ddp"):
        L.seed_everything(11)
        module = model()
        t = trainer(strategy, max_steps=3)
        t.fit(module, models.loader(models.IndexedData(), 4))
        finals.append(t.strategy.full_state_dict() if strategy != "ddp" else module.state_dict())
    return {**run_scale(t), "param_diff": max_diff(*finals) if RANK == 0 else None}


def head_after_forward(accumulate: int, **options) -> dict:
    """``models.HeadAfterForward`` at stage 3 (``options``: more settings) against Lightning's ``ddp``."""
    finals = []
    for strategy in (ZeroStrategy(stage=3, **options), "ddp"):
        L.seed_everything(11)
        module = models.HeadAfterForward()
        t = trainer(strategy, max_steps=3, accumulate_grad_batches=accumulate, gradient_clip_val=0.5)
        t.fit(module, models.loader(models.IndexedData(), 4))
        finals.append(t.strategy.full_state_dict() if strategy != "ddp" else module.state_dict())
    return {**run_scale(t), "param_diff": max_diff(*finals) if RANK == 0 else None}


def final_state(model, stage, options=None, **trainer_kwargs) -> dict:
    """``model()`` fitted for an epoch with accumulation 2: the final weights. ``stage`` 0: Lightning's ``ddp``."""
    L.seed_everything(7)
    strategy = ZeroStrategy(stage=stage, state_dict_type="full", **(options or {})) if stage else "ddp"
    t = trainer(strategy, max_epochs=1, accumulate_grad_batches=2, **trainer_kwargs)
    module = model()
    t.fit(module, models.loader(models.IndexedData(), 4))
    state = t.strategy.full_state_dict() if stage else module.state_dict()
    return {"state": {k: v.tolist() for k, v in state.items()}, **run_scale(t)} if RANK == 0 else {}


def skipped_steps(stage) -> dict:
    """Windows whose step is skipped must not leak their gradients into the next window; a step taken without the
    closure must still step."""
    return final_state(models.SkipsSomeSteps, stage)


def stepped_by_hand(stage, **options) -> dict:
    """A parameter no optimizer holds, stepped by the module itself (``models.SteppedByHand``), with clipping."""
    out = final_state(models.SteppedByHand, stage, options, gradient_clip_val=0.5)
    if out:  # the gain's own rule steps it by 0.1 times its gradient (SGD-like, its gradient below 1)
        out["lr"] = max(out["lr"], 0.1)
    return out


def epoch_ended_inside_a_window(strategy, precision: str = "32-true") -> dict:
    """``models.EndsAnEpochInsideAWindow`` for 2 epochs with accumulation 2 (clipping, StepLR): the final weights."""
    L.seed_everything(7)
    t = trainer(strategy, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, precision=precision)
    module = models.EndsAnEpochInsideAWindow()
    t.fit(module, models.loader(models.IndexedData(), 4))
    state = t.strategy.full_state_dict() if isinstance(t.strategy, ZeroStrategy) else module.state_dict()
    return {**run_scale(t), "state": {k: v.tolist() for k, v in state.items()}} if RANK == 0 else {}


class GradRowsProbe(L.Callback):
    """Stage 1's ``p.grad`` where the docs say what it holds (docs/lightning-features.md, "Gradients in your hooks"):
    in ``on_before_optimizer_step``, this rank's rows of the averaged gradient and zeros elsewhere."""

    def __init__(self) -> None:
        self.checked, self.own_rows_diff, self.other_rows_zero = 0, 0.0, True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        full = trainer.strategy.gather_gradients()
        for name, p in pl_module.named_parameters():
            if p.grad is None or name not in full:
                continue
            start, end = shard.element_range(p.shape, RANK, WORLD)
            flat, expected = p.grad.reshape(-1), full[name].reshape(-1)
            self.own_rows_diff = max(
                self.own_rows_diff, float((flat[start:end] - expected[start:end]).abs().max()) if end > start else 0.0
            )
            self.other_rows_zero &= bool(flat[:start].eq(0).all() and flat[end:].eq(0).all())
            self.checked += 1


def stage1_grad_rows() -> dict:
    """Accumulation and clipping, as the exactness runs; the probe looks at every step's gradients."""
    L.seed_everything(5)
    probe = GradRowsProbe()
    data = models.IndexedData()
    t = trainer(ZeroStrategy(stage=1), max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5, callbacks=[probe])
    t.fit(models.Tour(), models.loader(data, 4))
    return {"checked": probe.checked, "own_rows_diff": probe.own_rows_diff, "other_rows_zero": probe.other_rows_zero}


def tour(stage, precision: str = "32-true", callbacks=()) -> dict:
    L.seed_everything(5)
    module = models.Tour()
    frozen_before = module.frozen.weight.detach().clone()
    data = models.IndexedData()
    t = trainer(
        ZeroStrategy(stage=stage, state_dict_type="full"),
        max_epochs=2,
        limit_val_batches=2,
        precision=precision,
        callbacks=list(callbacks),
    )
    t.fit(module, models.loader(data, 4), models.loader(data, 4))
    out = {
        "epochs": t.current_epoch,
        "lr": t.optimizers[0].param_groups[0]["lr"],
        "val_mse": float(t.callback_metrics["val_mse"]),
        "train_loss": float(t.callback_metrics["train_loss"]),
    }
    state = t.strategy.full_state_dict()
    if RANK == 0:
        out["frozen_unchanged"] = bool(torch.equal(state["frozen.weight"], frozen_before))
        out["bn_batches"] = int(state["body.1.num_batches_tracked"])
    tested = t.test(module, models.loader(data, 4), verbose=False)
    out["test_loss"] = tested[0]["test_loss"]
    predictions = t.predict(module, models.loader(data, 8))
    out["predictions"] = [list(p.shape) for p in predictions]
    validated = t.validate(module, models.loader(data, 4), verbose=False)
    out["validate_mse"] = validated[0]["val_mse"]
    out["inference_mode"] = [loop.inference_mode for loop in (t.validate_loop, t.test_loop, t.predict_loop)]
    return out


class StateBytesProbe(L.Callback):
    """Bytes of every live tensor storage right after backward, counted from outside via the GC."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.bytes = None

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.at_step and self.bytes is None:
            self.bytes = live_tensor_bytes()


def memory(stage) -> dict:
    L.seed_everything(0)
    module = models.Wide()
    params = sum(p.numel() for p in module.parameters())
    probe = StateBytesProbe(at_step=2)
    t = trainer(ZeroStrategy(stage=stage), max_steps=3, callbacks=[probe])
    t.fit(module, models.loader(models.WideData(module.width), 8))
    return {"bytes": probe.bytes, "params": params}


class CommProbe(L.Callback):
    """Collective elements issued during each micro-batch (forward + backward) and each optimizer step."""

    def __init__(self) -> None:
        self.micro = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        comm_stats().reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.micro.append(comm_stats().snapshot())


def communication(stage, accumulate) -> dict:
    L.seed_everything(0)
    module = models.Wide(width=64, depth=3)
    params = sum(p.numel() for p in module.parameters())
    probe = CommProbe()
    t = trainer(ZeroStrategy(stage=stage), max_steps=2, accumulate_grad_batches=accumulate, callbacks=[probe])
    t.fit(module, models.loader(models.WideData(module.width), 4))
    return {"micro": probe.micro, "params": params}


def checkpointing_is_exact(stage: int) -> dict:
    """The same GPT (dropout 0.1) trained with and without activation checkpointing of its blocks."""
    from torch.distributed._composable import checkpoint

    from lightning_zero.demo import GPTLightningModule
    from lightning_zero.demo.gpt import Block

    finals = []
    for policy in (None, {"classes": [Block]}):
        L.seed_everything(3)
        module = GPTLightningModule(vocab_size=16, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
        t = trainer(
            ZeroStrategy(stage=stage, activation_checkpointing=policy, state_dict_type="full"),
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
            limit_val_batches=0,
        )
        data = [(torch.randint(0, 16, (16,), generator=torch.Generator().manual_seed(i)),) * 2 for i in range(48)]
        t.fit(module, torch.utils.data.DataLoader([(x, torch.roll(x, -1)) for (x, _) in data], batch_size=4))
        finals.append(t.strategy.full_state_dict())
        checkpointed = [checkpoint.state(b) is not None for b in module.model.blocks]
    out = {"checkpointed_blocks": sum(checkpointed), "trained": t.global_step, **run_scale(t)}
    if RANK == 0:
        out["param_diff"] = max_diff(finals[0], finals[1])
        out["param_names_equal"] = sorted(finals[0]) == sorted(finals[1])
    out["normalized"] = normalized_blocks_checkpointed(stage)
    return out


class NormalizedBlock(nn.Module):
    """A convolution, BatchNorm and a spectral-norm projection: a forward that updates buffers (running statistics,
    the batch count, power-iteration vectors), which its recomputation must not update again."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(4, 4, 3, padding=1), nn.BatchNorm1d(4)
        self.projection = nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6))

    def forward(self, x):
        return self.projection(torch.relu(self.bn(self.conv(x))))


class NormalizedNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(NormalizedBlock(), NormalizedBlock())

    def training_step(self, batch, batch_idx):
        return self.blocks(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(models.param_groups(self), lr=1e-2)


def normalized_blocks_checkpointed(stage: int) -> dict:
    """``NormalizedNet`` with and without its blocks checkpointed: the same parameters and buffers (BatchNorm counted
    each batch twice and spectral norm's recomputed weight was an iteration further on, before [Note: buffers under
    recomputation])."""
    finals = []
    for policy in (None, NormalizedBlock):
        L.seed_everything(3)
        t = trainer(
            ZeroStrategy(stage=stage, activation_checkpointing=policy, state_dict_type="full"),
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
        )
        data = torch.utils.data.TensorDataset(torch.randn(48, 4, 6, generator=torch.Generator().manual_seed(1)))
        t.fit(NormalizedNet(), models.loader(data, 4))
        finals.append(t.strategy.full_state_dict())
    if RANK != 0:
        return {}
    return {
        "diff": max_diff(finals[0], finals[1]),
        "batches_tracked": int(finals[1]["blocks.0.bn.num_batches_tracked"]),
        **run_scale(t),
    }


class FrozenHeadUnfrozenAtEpochOne(L.Callback):
    """Unfreezes ``Regression.unused`` (a head no batch uses) into a param group of its own at epoch 1."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.unused.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.unused.parameters()), "weight_decay": 0.1})


def unfrozen_unused_head(stage: int) -> dict:
    """A head frozen when the strategy set up, unfrozen during ``fit``, used by no rank: plain PyTorch leaves its
    gradient ``None`` and AdamW never moves it (no weight decay either)."""
    L.seed_everything(7)
    module = models.Regression(unused_head=True)
    module.unused.requires_grad_(False)
    initial = {k: v.clone() for k, v in module.unused.state_dict().items()}
    t = trainer(
        ZeroStrategy(stage=stage, state_dict_type="full"),
        max_epochs=2,
        limit_train_batches=4,
        callbacks=[FrozenHeadUnfrozenAtEpochOne()],
    )
    t.fit(module, models.loader(models.IndexedData(), 4))
    final = t.strategy.full_state_dict()
    return {
        "steps": t.global_step,
        "head_change": max(float((final[f"unused.{k}"] - v).abs().max()) for k, v in initial.items())
        if RANK == 0
        else None,
    }


def routed_mixed(precision: str) -> dict:
    """``models.RoutedNet`` (experts picked per rank) with accumulation under mixed precision at stages 2 and 3:
    FSDP2 accumulates a window's gradients upcast to fp32 and packs a unit's only when they share a dtype, so an
    expert picked first in the window's last micro-batch must join them upcast. Stage 2 as the reference: the same
    arithmetic but for the order of the sums."""
    from lightning_zero import ZeroPrecision

    finals = {}
    for stage in (2, 3):
        L.seed_everything(7)
        module = models.Regression(routed=True)
        initial = {k: v.clone() for k, v in module.state_dict().items()}
        kwargs = (
            {"plugins": [ZeroPrecision("16-mixed", initial_scale=2.0**10)]}
            if precision == "16-mixed"
            else {"precision": precision}
        )
        t = trainer(
            ZeroStrategy(stage=stage, state_dict_type="full"),
            max_steps=4,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
            **kwargs,
        )
        t.fit(module, models.loader(models.IndexedData(), 4))
        finals[stage] = {k: v.float() for k, v in t.strategy.full_state_dict().items()}
    if RANK != 0:
        return {}
    return {
        "steps": t.global_step,
        "stage3_vs_stage2": max_diff(finals[3], finals[2]),
        "change": max_diff(finals[3], initial),
    }


def registered_name() -> dict:
    return exactness(2, strategy="zero2")


CASES = {
    "exact": lambda: {
        **{f"stage{s}": exactness(s) for s in (1, 2, 3)},
        **{f"stage{s}_small_buckets": exactness(s, bucket_size_mb=0.0005) for s in (1, 2)},
        "stage3_configure_model": exactness(3, build_in_configure_model=True),
        "stage3_one_unit_per_layer": exactness(
            3, strategy=ZeroStrategy(stage=3, unit_size_mb=0, state_dict_type="full")
        ),
        "stage2_configure_model": exactness(2, build_in_configure_model=True),
        **{f"stage{s}_clip_value": exactness(s, clip_algorithm="value") for s in (1, 2, 3)},
        "registered_zero2": registered_name(),
        **{
            f"stage{s}_reduce_every_microbatch": exactness(
                s, strategy=ZeroStrategy(stage=s, reduce_every_microbatch=True, state_dict_type="full")
            )
            for s in (1, 2)
        },
        "stage1_no_overlap": exactness(1, strategy=ZeroStrategy(stage=1, overlap_comm=False, state_dict_type="full")),
        **{f"stage{s}_unused_parameter": exactness(s, unused_head=True) for s in (1, 2, 3)},
        **{f"stage{s}_routed": exactness(s, routed=True) for s in (1, 2, 3)},
        "stage2_penalty": exactness(2, penalty=0.1),
        "stage3_penalty": exactness(
            3, penalty=0.1, strategy=ZeroStrategy(stage=3, unit_size_mb=0, state_dict_type="full")
        ),
        # the blocks recomputed once for the penalty's backward and once for the loss's
        "stage3_penalty_checkpointed": exactness(
            3,
            penalty=0.1,
            strategy=ZeroStrategy(
                stage=3, unit_size_mb=0, activation_checkpointing={torch.nn.Sequential}, state_dict_type="full"
            ),
        ),
        "stage2_reversible": exactness(2, reversible=True),
        # every unit resharded after its forward, so the layers the stack's backward runs meet the shards
        "stage3_reversible": exactness(
            3,
            reversible=True,
            strategy=ZeroStrategy(stage=3, unit_size_mb=0, reduce_every_microbatch=True, state_dict_type="full"),
        ),
        "stage3_reversible_offload_params": exactness(
            3, reversible=True, strategy=ZeroStrategy(stage=3, offload_params=True, state_dict_type="full")
        ),
    },
    "features": lambda: {
        **{f"manual_stage{s}": manual_two_optimizers(s) for s in (1, 2, 3)},
        **{f"untoggled_stage{s}": manual_two_optimizers(s, models.UntoggledWGAN) for s in (1, 2, 3)},
        "untoggled_stage1_offloaded": manual_two_optimizers(1, models.UntoggledWGAN, offload_optimizer=True),
        "sharpness_aware_stage3": sharpness_aware(3),
        **{f"sharpness_aware_gathered_stage{s}": sharpness_aware(s, models.SharpnessAwareGathered) for s in (1, 2)},
        "sharpness_aware_gathered_stage1_offloaded": sharpness_aware(
            1, models.SharpnessAwareGathered, offload_optimizer=True
        ),
        "head_after_forward": head_after_forward(1),
        "head_after_forward_accumulated_offloaded": head_after_forward(2, offload_params=True, offload_optimizer=True),
        **{f"tour_stage{s}": tour(s) for s in (1, 2, 3)},
        "stage1_grad_rows": stage1_grad_rows(),
        **{f"skipped_steps_stage{s}": skipped_steps(s) for s in (0, 1, 2, 3)},
        **{f"stepped_by_hand_stage{s}": stepped_by_hand(s) for s in (0, 1, 2, 3)},
        "stepped_by_hand_stage2_offloaded": stepped_by_hand(2, offload_optimizer=True),
        **{f"unfrozen_unused_head_stage{s}": unfrozen_unused_head(s) for s in (2, 3)},
        **{f"routed_{p}": routed_mixed(p) for p in ("16-mixed", "bf16-mixed")},
        **{f"epoch_ended_{s}": epoch_ended_inside_a_window(ZeroStrategy(stage=s) if s else "ddp") for s in (0, 2, 3)},
    },
    "features_rest": lambda: {
        "epoch_ended_1": epoch_ended_inside_a_window(ZeroStrategy(stage=1)),
        "epoch_ended_3_offload_params": epoch_ended_inside_a_window(ZeroStrategy(stage=3, offload_params=True)),
        **{f"epoch_ended_{s}_bf16": epoch_ended_inside_a_window(ZeroStrategy(stage=s), "bf16-mixed") for s in (2, 3)},
    },
    "costs": lambda: {
        **{f"memory_stage{s}": memory(s) for s in (1, 2, 3)},
        **{f"comm_stage{s}": communication(s, 1) for s in (1, 2, 3)},
        **{f"comm_accum_stage{s}": communication(s, 3) for s in (1, 2, 3)},
    },
    "single": lambda: {f"stage{s}": exactness(s) for s in (1, 2, 3)},
    "checkpointing": lambda: {f"stage{s}": checkpointing_is_exact(s) for s in (1, 2, 3)},
}


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
