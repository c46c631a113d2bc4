"""Rank program for the CPU-offload tests (pattern: worker_core): exactness against the same run without
offload, where every state tensor lives, the largest tensor the optimizer ever creates, bytes by placement,
and checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_zero import ZeroStrategy
from lightning_zero.observability.monitor import ZeroMonitor
from lightning_zero.planning.accounting import live_tensor_bytes, model_state_bytes
from tests.distributed import delayed_update_cases, models
from tests.distributed.worker_checkpoint import interrupted, optim_diff, optim_scale, straight
from tests.distributed.worker_core import RANK, WORLD, GradientRecorder, max_diff, run_scale, trainer
from tests.distributed.worker_precision import overflow_skips_step
from tests.launch import run_cases_with_directory

#: (name, stage, ZeroStrategy settings) of every offload configuration.
CONFIGS = [
    # Small buckets: several per rank, so gradients go to the host bucket by bucket as their reductions land and
    # the host steps in parts (see [Note: the offloaded step]).
    ("stage1_optimizer", 1, dict(offload_optimizer=True, bucket_size_mb=0.001)),
    ("stage2_optimizer", 2, dict(offload_optimizer=True, bucket_size_mb=0.001)),
    ("stage3_optimizer", 3, dict(offload_optimizer=True)),
    ("stage3_params", 3, dict(offload_optimizer=True, offload_params=True)),
]
STEPS, ACCUMULATE, BATCH, CLIP = 4, 2, 4, 0.5


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an operation produces inside the block (a DTensor by
    its local shard): state an optimizer allocates, temporaries of its kernels, the tensors it updates."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, _local(t).numel())
        return out


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that remembers the largest tensor any of its steps produced."""

    largest = 0

    def step(self, closure=None):
        with LargestTensor() as probe:
            result = super().step(closure)
        RecordingAdamW.largest = max(RecordingAdamW.largest, probe.numel)
        return result


class RecordedRegression(models.Regression):
    def configure_optimizers(self):
        opt = RecordingAdamW(models.param_groups(self), lr=1e-2, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _storages(tensors) -> set[int]:
    return {_local(t).untyped_storage().data_ptr() for t in tensors}


def placement(t: L.Trainer) -> dict:
    """Where the optimizer's state and the tensors it keys that state by live, and their sizes."""
    engine = t.strategy.engine
    module = t.lightning_module
    optimizer = t.optimizers[0]
    hosted = engine.optimizer_shards(optimizer).hosted()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = [hosted.get(id(p), p) for p in params]
    shard_numel = [_local(p).numel() for p in params] if engine.stage == 3 else [k.numel() for k in keys]
    state = [optimizer.state[k] for k in keys]
    tensors = [v for entry in state for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    module_storages = _storages([*module.parameters(), *(p.grad for p in module.parameters() if p.grad is not None)])
    return {
        "state_devices": sorted({_local(v).device.type for v in tensors}),
        "key_devices": sorted({_local(k).device.type for k in keys}),
        "state_numel_is_shard": all(
            _local(v).numel() == n for entry, n in zip(state, shard_numel) for v in entry.values() if v.dim() > 0
        ),
        "state_is_dtensor": all(isinstance(v, DTensor) for v in tensors),
        "keys_are_masters": all(k is not p for k, p in zip(keys, params)),
        "state_shares_module_storage": bool(_storages(tensors) & module_storages),
        "keys_share_module_storage": bool(_storages(keys) & module_storages),
        "max_shard_numel": max(shard_numel),
        "max_full_numel": max(p.numel() for p in params),
    }


def _optimizer_bytes(t: L.Trainer, host_only: bool) -> int:
    """Bytes of optimizer state tensors (scalar step counters aside), or of those the engine placed on the host."""
    engine, optimizer = t.strategy.engine, t.optimizers[0]
    return sum(
        _local(v).untyped_storage().nbytes()
        for key, entry in optimizer.state.items()
        if not host_only or engine.on_host(key)
        for v in entry.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def run(stage: int, settings: dict, precision: str = "32-true", model=models.Regression) -> tuple[dict, dict]:
    """4 steps of 2 accumulated micro-batches with clipping, 2 param groups and a StepLR schedule."""
    L.seed_everything(7)
    module = model()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    recorder = GradientRecorder()
    schedule = ScheduleProbe()
    RecordingAdamW.largest = 0
    t = trainer(
        ZeroStrategy(stage=stage, state_dict_type="full", **settings),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        precision=precision,
        callbacks=[recorder, schedule] if stage < 3 and settings.get("offload_optimizer") else [recorder],
    )
    data = models.IndexedData()
    t.fit(module, models.loader(data, BATCH))
    out = {
        "staged_on_landing": schedule.staged_on_landing,
        "host_step_parts": schedule.parts,
        **run_scale(t),
        "placement": placement(t),
        "largest_step_tensor": RecordingAdamW.largest,
    }
    out["bytes"] = model_state_bytes(module, [t.optimizers[0]], t.strategy.engine)
    out["bytes"]["optimizer_tensors"] = _optimizer_bytes(t, host_only=False)
    out["bytes"]["optimizer_host"] = _optimizer_bytes(t, host_only=True)
    out["shard_elements"] = [r.rows.numel() for r in t.strategy.engine.records()]
    final = t.strategy.full_state_dict()
    if RANK == 0 and precision == "32-true":
        ref_params, ref_grads, _ = models.reference_run(
            initial, data, world=WORLD, batch=BATCH, steps=STEPS, accumulate=ACCUMULATE, clip=CLIP
        )
        out["param_diff_reference"] = max_diff(final, ref_params)
        out["grad_diff_reference"] = max(max_diff(g, r) for g, r in zip(recorder.steps, ref_grads))
    return out, final


def exactness() -> dict:
    out = {}
    plain: dict[tuple, dict] = {}
    for precision in ("32-true", "bf16-mixed"):
        for name, stage, settings in CONFIGS:
            if precision != "32-true" and name == "stage1_optimizer":
                continue  # stage 1 and 2 share the offload path; keep the bf16 cases few
            if (stage, precision) not in plain:
                plain[(stage, precision)] = run(stage, {}, precision)[1]
            result, final = run(stage, settings, precision, model=RecordedRegression)
            if RANK == 0:
                result["param_diff_no_offload"] = max_diff(final, plain[(stage, precision)])
            out[f"{name}_{precision}"] = result
    for name, stage, settings in CONFIGS[1:]:
        out[f"{name}_overflow"] = overflow_skips_step(stage, **settings)
    for name in ("zero2_offload", "zero3_offload"):
        L.seed_everything(7)
        t = trainer(name, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP)
        t.fit(models.Regression(), models.loader(models.IndexedData(), BATCH))
        final = t.strategy.full_state_dict()
        stage = t.strategy.stage
        config = t.strategy.zero_config
        out[name] = {
            "stage": stage,
            "offload_optimizer": config.offload_optimizer,
            "offload_params": config.offload_params,
            **run_scale(t),
        }
        if RANK == 0:
            out[name]["param_diff_no_offload"] = max_diff(final, plain[(stage, "32-true")])
    return out


class ScheduleProbe(L.Callback):
    """Stages 1-2: at every step, how many gradients the host got as their bucket's reduction landed (rather than
    when they were finalized), out of how many; and in how many parts the host steps."""

    def __init__(self) -> None:
        self.staged_on_landing: list[tuple[int, int]] = []
        self.parts = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        shards = trainer.strategy.engine.optimizer_shards(optimizer)
        finals = [r for r in shards.reducer.records if r.final is not None]
        self.staged_on_landing.append((sum(r.final is r.staged for r in finals), len(finals)))
        self.parts = len(shards.parts)


class PlacementProbe(L.Callback):
    """Model-state bytes by placement, and the GC's count of every live tensor the run added, before the third step
    (the host gradient buffers exist from the first step on). The count before the model was built is taken off: this
    process's pool may have run other programs before, whose libraries keep tensors of their own."""

    def __init__(self) -> None:
        self.bytes = None
        self.before = live_tensor_bytes()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 2:
            self.bytes = model_state_bytes(pl_module, trainer.optimizers, trainer.strategy.engine)
            self.bytes["live"] = live_tensor_bytes() - self.before


def memory() -> dict:
    out = {}
    for precision in ("32-true", "bf16-mixed"):
        for name, stage, settings in [("none_stage2", 2, {}), *CONFIGS]:
            if precision != "32-true" and name not in ("stage2_optimizer", "stage3_params"):
                continue
            out[f"{name}_{precision}"] = bytes_of_one_run(stage, settings, precision)
    return out


def bytes_of_one_run(stage: int, settings: dict, precision: str) -> dict:
    """One run's bytes by placement; its own function, so that the run before it is gone when the probe counts."""
    L.seed_everything(0)
    probe = PlacementProbe()
    module = models.Wide(width=512, depth=4)
    t = trainer(ZeroStrategy(stage=stage, **settings), max_steps=3, precision=precision, callbacks=[probe])
    t.fit(module, models.loader(models.WideData(module.width), 8))
    return {**probe.bytes, "params_count": sum(p.numel() for p in module.parameters())}


def checkpoints(directory: Path) -> dict:
    """Resume with and without offload on either side; compared with an uninterrupted run without offload."""
    out = {}
    cases = [
        ("stage2_offload->offload", 2, dict(offload_optimizer=True), dict(offload_optimizer=True), "sharded"),
        ("stage2_offload->plain", 2, dict(offload_optimizer=True), {}, "sharded"),
        ("stage3_plain->params", 3, {}, dict(offload_optimizer=True, offload_params=True), "sharded"),
        ("stage3_optimizer->optimizer_full", 3, dict(offload_optimizer=True), dict(offload_optimizer=True), "full"),
        ("stage3_params->params", 3, dict(offload_params=True), dict(offload_params=True), "sharded"),
    ]
    references = {}
    for name, stage, save, resume, fmt in cases:
        if stage not in references:
            references[stage] = straight(stage)
        params, optim, steps = interrupted(stage, stage, directory / name, fmt, save_kwargs=save, resume_kwargs=resume)
        if RANK == 0:
            ref_params, ref_optim = references[stage]
            out[name] = {
                "steps": steps,
                "param_diff": max_diff(params, ref_params),
                "optim_diff": optim_diff(optim, ref_optim),
                **optim_scale(ref_optim),
            }
    return out


def partial() -> dict:
    """``offload_optimizer=r``: the same parameters as no offload, and optimizer state on the host for the share
    of elements ``host_share`` picks (whole parameters, largest first within ``r``)."""
    from lightning_zero.engine.offload.masters import host_share

    out = {}
    for stage in (2, 3):
        _, plain = run(stage, {})
        for ratio in (0.25, 0.5):
            result, final = run(stage, {"offload_optimizer": ratio})
            t_bytes = result["bytes"]
            engine_rows = result.pop("shard_elements")
            chosen = host_share(engine_rows, ratio)
            planned = sum(n for n, host in zip(engine_rows, chosen) if host) / sum(engine_rows)
            out[f"stage{stage}_{ratio}"] = {
                "param_diff_no_offload": max_diff(final, plain) if RANK == 0 else None,
                "param_diff_reference": result.get("param_diff_reference"),
                "lr": result["lr"],
                "steps": result["steps"],
                "host_share_of_state": t_bytes["optimizer_host"] / t_bytes["optimizer_tensors"],
                "planned_share": planned,
                "largest_share": max(engine_rows) / sum(engine_rows),
            }
    _, plain = run(2, {}, "bf16-mixed")  # device masters are fp32 copies here, host ones as with full offload
    result, final = run(2, {"offload_optimizer": 0.5}, "bf16-mixed")
    out["stage2_0.5_bf16"] = {
        "param_diff_no_offload": max_diff(final, plain) if RANK == 0 else None,
        "lr": result["lr"],
        "steps": result["steps"],
    }
    return out


class EarlyProbe(L.Callback):
    """At every step, how many parts of the offloaded step started during backward, and how many of the optimizer's
    pieces were still to land when the first of them started: read as the step takes them, since a callback with
    a hook between backward and the step keeps the whole step for ``optimizer.step()``."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def on_train_start(self, trainer, pl_module):
        early = trainer.strategy.engine.optimizer_shards(trainer.optimizers[0]).schedule
        take = early.take

        def noting_take():
            started = take()
            self.steps.append((len(started), max((p.pieces_in_flight for p in started), default=0)))
            return started

        early.take = noting_take


def during_backward(only: tuple[str, ...] | None = None) -> dict:
    """No clipping, no loss scaler: the host steps parts while backward runs ([Note: the host step during backward]),
    against the same run keeping the whole step for ``optimizer.step()`` (``overlap_comm=False``) and plain PyTorch;
    ``unused``: a head no rank uses, whose part must wait for the step; ``reduce_every_microbatch``: the first
    micro-batch's reductions land too, but only the last one's gradients are the step's."""
    out = {}
    data = models.IndexedData()
    cases = [
        ("stage1", 1, False, False, False),
        ("stage2", 2, False, False, False),
        ("stage2_unused", 2, True, False, False),
        ("stage2_every_microbatch", 2, False, True, False),
        ("stage3", 3, False, False, False),
        ("stage3_unused", 3, True, False, False),
        ("stage3_reduced_in_place", 3, False, False, True),
    ]
    for name, stage, unused, every, hooked in cases:
        if only is not None and name not in only:
            continue
        finals, norms = {}, {}
        # Stage 3: one unit per layer, so that units finish one by one during backward.
        pieces = dict(bucket_size_mb=0.001) if stage < 3 else dict(unit_size_mb=0)
        for overlap in (True, False):
            L.seed_everything(7)
            module = (HookedRegression if hooked else delayed_update_cases.NotingRegression)(unused_head=unused)
            initial = {k: v.clone() for k, v in module.state_dict().items()}
            probe = EarlyProbe()
            # the monitor's gradient norm reads the gradients between backward and the step, and leaves parts started
            monitor = ZeroMonitor(log_every_n_steps=1, prog_bar=False, grad_norm_type=2)
            delayed_update_cases.ThreadNotingAdamW.threads = set()
            t = trainer(
                ZeroStrategy(
                    stage=stage,
                    offload_optimizer=True,
                    overlap_comm=overlap,
                    reduce_every_microbatch=every,
                    state_dict_type="full",
                    **pieces,
                ),
                max_steps=STEPS,
                accumulate_grad_batches=ACCUMULATE,
                callbacks=[probe, monitor],
            )
            t.fit(module, models.loader(data, BATCH))
            finals[overlap] = t.strategy.full_state_dict()
            norms[overlap] = monitor.last.get("monitor/grad_2_norm")
            if overlap:
                module_now = {
                    n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in module.named_parameters()
                }
                shards = t.strategy.engine.optimizer_shards(t.optimizers[0])
                result = {
                    "steps": t.global_step,
                    "early": probe.steps,
                    "parts": len(shards.parts if stage < 3 else shards.unit_parts),
                    "threads": sorted(delayed_update_cases.ThreadNotingAdamW.threads),
                }
            else:
                result["serial_early"] = probe.steps
                result["monitor_grad_norms"] = (norms[True], norms[False])
        if RANK == 0:
            reference, _, _ = models.reference_run(
                initial,
                data,
                world=WORLD,
                batch=BATCH,
                steps=STEPS,
                accumulate=ACCUMULATE,
                clip=0.0,
                unused_head=unused,
                optimizer=delayed_update_cases.noting_optimizer,
            )
            result["module_diff"] = max_diff(module_now, finals[True])
            result["param_diff_serial"] = max_diff(finals[True], finals[False])
            result["param_diff_reference"] = max_diff(finals[True], reference)
        out[name] = result
    return out if only is not None else {**out, **refusals(2)}


class StartProbe(L.Callback):
    """How many parts of the offloaded step started during backward, over the whole fit, and the most bytes their
    copies ([Note: speculative clipping]) held when the clip read their norms."""

    def __init__(self) -> None:
        self.started = 0
        self.copied_bytes = 0

    def on_train_start(self, trainer, pl_module):
        schedule = trainer.strategy.engine.optimizer_shards(trainer.optimizers[0]).schedule
        start, norms = schedule.start, schedule.speculated_norms

        def counting_start(*args, **kwargs):
            self.started += 1
            return start(*args, **kwargs)

        def measuring_norms():
            known = norms()
            copies = [
                tensor
                for each in schedule.started
                for noted in each.speculated
                for _, copy, state in noted.saved
                for tensor in [copy, *(v for v in (state or {}).values() if isinstance(v, torch.Tensor))]
            ]
            copied = sum(_local(t).numel() * t.element_size() for t in copies)
            self.copied_bytes = max(self.copied_bytes, copied)
            return known

        schedule.start, schedule.speculated_norms = counting_start, measuring_norms


#: Clipping values that fire on no step of the run, on every step of it and on 2 of its 6 steps, at every stage.
NEVER_FIRES, ALWAYS_FIRES, SOME_FIRE = 1e6, 0.05, 2.0


class ClampsByHandInTheClosure(models.Regression):
    """Clamps the gradients by hand inside the closure (an ``optimizer_step`` override), where parts were stepped
    speculatively and Lightning's clip by norm comes after: they are put back and stepped with the clamped gradients."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        def closure():
            loss = optimizer_closure()
            self.trainer.precision_plugin.clip_grad_by_value(optimizer, 0.01)
            return loss

        optimizer.step(closure=closure)


def clipped_during_backward() -> dict:
    """Clipping by the global norm with the optimizer offloaded: the parts start during backward speculatively
    ([Note: speculative clipping]), against the same run keeping the whole step for ``optimizer.step()``
    (``overlap_comm=False``, today's clipped step): bit for bit, the clip firing on every step and on none; and with
    a clip between, firing on some steps. Clipping by value starts nothing early."""
    out = {}
    data = models.IndexedData()
    # `offload_params=True` alone (the optimizer state on the host with the parameters) as a user writes it.
    optimizer_only = {"offload_optimizer": True}
    for label, stage, offloaded in (
        (1, 1, optimizer_only),
        (2, 2, optimizer_only),
        (3, 3, optimizer_only),
        ("3_params", 3, {"offload_params": True}),
    ):
        pieces = dict(bucket_size_mb=0.001) if stage < 3 else dict(unit_size_mb=0)
        cases = [
            ("never", NEVER_FIRES, "norm", {}),
            ("always", ALWAYS_FIRES, "norm", {}),
            ("some", SOME_FIRE, "norm", {}),
        ]
        if stage == 2:  # clipping by value; the undo of state held in bf16
            cases += [
                ("value", 0.01, "value", {}),
                ("some_bf16_states", SOME_FIRE, "norm", {"optimizer_state_dtype": "bf16"}),
                ("clamped_by_hand", NEVER_FIRES, "norm", {}),
            ]
        if "offload_params" in offloaded:  # the parameters themselves stepped during backward, without clipping too
            cases += [("unclipped", None, None, {})]
        for name, clip, algorithm, settings in cases:
            finals, result = {}, {}
            for overlap in (True, False):
                L.seed_everything(7)
                probe = StartProbe()
                t = trainer(
                    ZeroStrategy(stage=stage, overlap_comm=overlap, **pieces, **offloaded, **settings),
                    max_steps=6,
                    accumulate_grad_batches=ACCUMULATE,
                    gradient_clip_val=clip,
                    gradient_clip_algorithm=algorithm,
                    callbacks=[probe],
                )
                module = ClampsByHandInTheClosure() if name == "clamped_by_hand" else models.Regression()
                t.fit(module, models.loader(data, BATCH))
                finals[overlap] = t.strategy.full_state_dict()
                precision = t.strategy.precision_plugin
                result["overlap" if overlap else "serial"] = {
                    "steps": t.global_step,
                    "parts_started": probe.started,
                    "copied_bytes": probe.copied_bytes,
                    "optimizer_host_bytes": _optimizer_bytes(t, host_only=True),
                    "master_bytes": sum(r.rows.numel() * 4 for r in t.strategy.engine.records()),
                    "param_names": [r.name for r in t.strategy.engine.records()],
                    "speculated_steps": precision.speculated_steps,
                    "clips_fired": precision.clips_fired,
                }
            if RANK == 0:
                result["param_diff_serial"] = max_diff(finals[True], finals[False])
            out[f"stage{label}_{name}"] = result
    return out


def refusals(stage: int) -> dict:
    """Clipping by hand after parts were stepped during backward, and a step skipped after them; clipping in a hook
    between backward and the step, which keeps the whole step for ``optimizer.step()``, against Lightning's own."""
    out = {}
    pieces = dict(bucket_size_mb=0.001) if stage < 3 else dict(unit_size_mb=0)
    for key, module in (("clip_in_closure", ClippingInClosure()), ("step_skipped", SkippingTheFirstStep())):
        t = trainer(ZeroStrategy(stage=stage, offload_optimizer=True, **pieces), max_steps=STEPS)
        try:
            t.fit(module, models.loader(models.IndexedData(), BATCH))
            out[f"{key}_stage{stage}"] = "no error"
        except RuntimeError as err:
            out[f"{key}_stage{stage}"] = str(err)
    finals, probe = {}, EarlyProbe()
    for make, clip, callbacks in ((ClippingInHook, None, [probe]), (delayed_update_cases.NotingRegression, 0.5, [])):
        L.seed_everything(7)
        module = make()
        t = trainer(
            ZeroStrategy(stage=stage, offload_optimizer=True, state_dict_type="full", **pieces),
            max_steps=STEPS,
            gradient_clip_val=clip,
            callbacks=callbacks,
        )
        t.fit(module, models.loader(models.IndexedData(), BATCH))
        finals[clip] = t.strategy.full_state_dict()
    out[f"clip_in_hook_stage{stage}"] = {
        "early": probe.steps,
        "diff": max_diff(finals[None], finals[0.5]) if RANK == 0 else None,
    }
    return out


class CountingAdamW(torch.optim.AdamW):
    """AdamW that counts the calls of its ``step``: one per part of an offloaded step."""

    calls = 0

    def step(self, closure=None):
        CountingAdamW.calls += 1
        return super().step(closure)


class CountingAdagrad(torch.optim.Adagrad):
    """Adagrad counted like :class:`CountingAdamW`: an optimizer whose fused CPU kernel does not take DTensors, so
    which kernel steps the host masters depends on what the step's groups hold."""

    def step(self, closure=None):
        CountingAdamW.calls += 1
        return super().step(closure)


class CountedRegression(models.Regression):
    """``models.Regression`` under :class:`CountingAdamW` (or ``CountingAdagrad``); ``hooked``: with a step hook, which
    keeps the step one call (``optimizers.steps_in_parts``)."""

    def __init__(self, hooked: bool = False, adagrad: bool = False) -> None:
        super().__init__()
        self.hooked, self.adagrad = hooked, adagrad

    def configure_optimizers(self):
        if self.adagrad:
            opt = CountingAdagrad(models.param_groups(self), lr=1e-2)
            if self.hooked:
                opt.register_step_pre_hook(lambda *_: None)
            return opt
        opt = CountingAdamW(models.param_groups(self), lr=1e-2, betas=(0.9, 0.95))
        if self.hooked:
            opt.register_step_pre_hook(lambda *_: None)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def stage3_parts(offloads: tuple[bool | float, ...]) -> dict:
    """Stage 3 with the optimizer offloaded (whole, and half of it): the host steps in parts, against the same run
    stepping everything in one call and plain PyTorch; 4 steps of 2 accumulated micro-batches with clipping."""
    out = {}
    data = models.IndexedData()
    for offload, adagrad in [(offload, False) for offload in offloads] + [(True, True)] * (True in offloads):
        name = ("full" if offload is True else "partial") + ("_adagrad" if adagrad else "")
        finals, calls = {}, {}
        for hooked in (False, True):
            L.seed_everything(7)
            module = CountedRegression(hooked, adagrad)
            initial = {k: v.clone() for k, v in module.state_dict().items()}
            CountingAdamW.calls = 0
            t = trainer(
                ZeroStrategy(stage=3, offload_optimizer=offload, state_dict_type="full"),
                max_steps=STEPS,
                accumulate_grad_batches=ACCUMULATE,
                gradient_clip_val=CLIP,
            )
            t.fit(module, models.loader(data, BATCH))
            finals[hooked], calls[hooked] = t.strategy.full_state_dict(), CountingAdamW.calls / t.global_step
        result = {"calls_per_step": calls[False], "calls_per_step_one_call": calls[True]}
        if RANK == 0 and adagrad:
            result["param_diff_one_call"] = max_diff(finals[False], finals[True])
        elif RANK == 0:
            reference, _, _ = models.reference_run(
                initial, data, world=WORLD, batch=BATCH, steps=STEPS, accumulate=ACCUMULATE, clip=CLIP
            )
            result["param_diff_one_call"] = max_diff(finals[False], finals[True])
            result["param_diff_reference"] = max_diff(finals[False], reference)
        out[name] = result
    return out


class HookedRegression(delayed_update_cases.NotingRegression):
    """A no-op post-accumulate-grad hook on every parameter: FSDP2 hands each reduced gradient to it, so the stage-3
    reductions complete in place rather than after backward (as on an accelerator, see [Note: reduce-scatters that
    land after backward])."""

    def on_fit_start(self):
        for param in self.parameters():
            param.register_post_accumulate_grad_hook(lambda _: None)


class SkippingTheFirstStep(delayed_update_cases.NotingRegression):
    """Runs the closure (forward and backward) of the first batch but not its step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx == 0:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


class ClippingInClosure(delayed_update_cases.NotingRegression):
    """Clips by hand inside the step's closure, right after backward, where neither Lightning nor a hook can show
    it: too late for parts the host already stepped."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        def clipping_closure():
            loss = optimizer_closure()
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            return loss

        optimizer.step(closure=clipping_closure)


class ClippingInHook(delayed_update_cases.NotingRegression):
    """Clips by hand in the hook before the step, where Lightning's clipping settings cannot see it."""

    def on_before_optimizer_step(self, optimizer):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


def delayed(directory: Path) -> dict:
    """``delayed_update_cases``'s group, with what the EMA's reordered-fp32 bound is derived from
    (``tests/tolerances.py``): its optimizer's learning rate and its steps (``max_steps``)."""
    out = delayed_update_cases.CASES["delayed"](directory)
    if RANK == 0:
        opt, _ = delayed_update_cases.noting_optimizer(models.Regression())
        out["ema"].update(lr=max(g["lr"] for g in opt.param_groups), steps=delayed_update_cases.STEPS)
    return out


CASES = {
    "exact": lambda _: exactness(),
    "memory": lambda _: memory(),
    "checkpoint": checkpoints,
    "partial": lambda _: partial(),
    "during_backward": lambda _: during_backward(),
    "clipped_during_backward": lambda _: clipped_during_backward(),
    # one rank (one GPU's case): FSDP2 copies where it would reduce ([Note: units finished alone])
    "during_backward_alone": lambda _: during_backward(("stage2", "stage3")),
    "stage3_parts": lambda _: stage3_parts((True,)),
    **delayed_update_cases.CASES,
    "delayed": delayed,
    # the full marker's: stage 3's refusals and partial offload in parts (the code is stage 2's, the parts full's)
    "refusals_stage3": lambda _: refusals(3),
    "stage3_parts_partial": lambda _: stage3_parts((0.5,)),
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
