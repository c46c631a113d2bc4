"""Single-process references for the mixed-precision tests.

:func:`fp32_reference` is plain fp32 training on the same global batches. :func:`mixed_reference` does the
arithmetic a ZeRO mixed-precision run does, in one process and written out step by step: fp32 master
weights, a 2-byte compute copy (normalization layers kept fp32), each rank's micro-batch run separately
under autocast with the loss scaled, per-rank gradients summed in the reduce dtype, the sum held in the
dtype the stage holds it in, unscaled and averaged in fp32, an overflow check, clipping by global norm, and
AdamW on the masters.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import lightning as L
import torch

from lightning_zero.demo.gpt import GPTLightningModule
from lightning_zero.engine.mixed_precision import PrecisionPolicy
from tests.distributed import models


def _build(model: dict | Callable[[], L.LightningModule]) -> L.LightningModule:
    """The demo GPT from its keyword arguments, or any LightningModule with ``_loss(batch)`` from a factory."""
    return model() if callable(model) else GPTLightningModule(**model)


def _optimizer(module: GPTLightningModule):
    conf = module.configure_optimizers()
    if isinstance(conf, dict):
        return conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    return conf, None


def fp32_reference(
    initial: dict, model_kwargs, dataset, *, world: int, batch: int, steps: int, clip: float, accumulate: int = 1
) -> list[float]:
    """Loss of every micro-batch (mean over the ranks) of plain fp32 training."""
    return fp32_run(
        initial, model_kwargs, dataset, world=world, batch=batch, steps=steps, clip=clip, accumulate=accumulate
    )[0]


def fp32_run(
    initial: dict, model_kwargs, dataset, *, world: int, batch: int, steps: int, clip: float, accumulate: int = 1
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain fp32 training on the same global batches: per-micro-batch losses (mean over the ranks) and the
    final ``state_dict``."""
    model = _build(model_kwargs)
    model.load_state_dict(copy.deepcopy(initial))
    opt, sched = _optimizer(model)
    losses = []
    batches = models.global_microbatches(dataset, world, batch, steps * accumulate)
    for step in range(steps):
        opt.zero_grad()
        for per_rank in batches[step * accumulate : (step + 1) * accumulate]:
            loss = sum(model._loss(b) for b in per_rank) / world
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}


def mixed_reference(
    initial: dict,
    model_kwargs: dict,
    dataset,
    *,
    world: int,
    batch: int,
    steps: int,
    clip: float,
    policy: PrecisionPolicy,
    hold_sum_in_param_dtype: bool,
    loss_scale: float = 1.0,
    growth_interval: int = 2000,
    shard_groups: int = 1,
    held: dict[str, torch.dtype] | None = None,
) -> dict:
    """Final fp32 masters, per-step losses and the skipped-step count of the emulated mixed run.

    ``hold_sum_in_param_dtype``: stages 1-2 keep the reduced gradient sum in the parameter's dtype before
    unscaling it into fp32; stage 3 (FSDP2) receives it into an fp32 shard. ``shard_groups``: hybrid sharding
    over that many groups of consecutive ranks: each group's sum is held as above, then the groups' held sums
    are added in the reduce dtype (and held again). ``held``: the dtype a run holds a named parameter in, where
    that is not the policy's (stage 3 holds a layer whose holder computes with its parameters in the dtype of the
    unit holding it).
    """
    master = _build(model_kwargs)
    master.load_state_dict(copy.deepcopy(initial))
    opt, sched = _optimizer(master)
    compute = copy.deepcopy(master)
    dtypes = policy.param_dtypes(compute)
    dtypes.update({id(p): held[name] for name, p in compute.named_parameters() if held and name in held})
    with torch.no_grad():
        for p in compute.parameters():
            p.data = p.data.to(dtypes[id(p)])
    named_master = dict(master.named_parameters())
    losses, skipped, clean = [], 0, 0
    for per_rank in models.global_microbatches(dataset, world, batch, steps):
        with torch.no_grad():
            for name, p in compute.named_parameters():
                p.copy_(named_master[name])
        group_size = world // shard_groups
        sums: list[dict[str, torch.Tensor]] = [{} for _ in range(shard_groups)]
        step_losses = []
        for rank, micro in enumerate(per_rank):
            compute.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=policy.compute_dtype, cache_enabled=False):
                loss = compute._loss(micro)
            (loss * loss_scale).backward()
            step_losses.append(loss.item())
            group = sums[rank // group_size]
            for name, p in compute.named_parameters():
                g = p.grad.to(_comm_dtype(p.grad.dtype, policy))
                group[name] = g if name not in group else group[name] + g
        losses.append(sum(step_losses) / world)
        grads = {}
        for name, p in compute.named_parameters():
            held_by_group = [group[name].to(p.dtype) if hold_sum_in_param_dtype else group[name] for group in sums]
            held = held_by_group[0]
            for other in held_by_group[1:]:  # hybrid sharding: the replica groups' all-reduce
                held = held.to(_comm_dtype(held.dtype, policy)) + other.to(_comm_dtype(other.dtype, policy))
                held = held.to(p.dtype) if hold_sum_in_param_dtype else held
            grads[name] = held.float() * (1.0 / (world * loss_scale))
        found_inf = any(not torch.isfinite(g).all() for g in grads.values())
        if not found_inf:
            if clip:
                total = math.sqrt(
                    sum(float(torch.linalg.vector_norm(g.float(), 2).double() ** 2) for g in grads.values())
                )
                coef = torch.clamp(clip / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0)
                for g in grads.values():
                    g.mul_(coef)
            for name, p in named_master.items():
                p.grad = grads[name]
            opt.step()
            clean += 1
            if clean == growth_interval:
                loss_scale *= 2.0
                clean = 0
        else:
            skipped += 1
            clean = 0
            loss_scale *= 0.5
        if sched is not None:
            sched.step()
    return {
        "params": {n: p.detach().clone() for n, p in master.state_dict().items()},
        "losses": losses,
        "skipped": skipped,
    }


def _comm_dtype(held: torch.dtype, policy: PrecisionPolicy) -> torch.dtype:
    """The reduce dtype, unless the gradient is held in a wider one (fp32 layers)."""
    return policy.reduce_dtype if held.itemsize <= policy.reduce_dtype.itemsize else held
