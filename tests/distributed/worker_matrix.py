"""Rank program for matrix optimizers (Muon, Adafactor, a Muon+AdamW mix) under every stage (pattern: worker_core).

Groups: ``exact`` (stages 1-3 against plain PyTorch, Newton-Schulz calls counted), ``manual`` (two optimizers
with manual optimization, torch's own Muon against Lightning ``ddp``), ``variants`` (mixed precision, offload,
state bytes, checkpoints within one world size, the refusal), and ``save_s2`` / ``resume_s3`` / ``resume_s2``:
one checkpoint crossing world sizes and stages, across launches (``LZ_SHARED_DIR``).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import state_dicts
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.engine.comm import collectives
from tests.distributed import matrix_models as mm
from tests.distributed import models
from tests.distributed.mixed_reference import mixed_reference
from tests.distributed.worker_core import RANK, WORLD, max_diff, trainer
from tests.launch import run_cases_with_directory

STEPS, ACCUMULATE, BATCH, CLIP = 4, 2, 4, 0.5
MATRIX = (mm.FP32Muon, mm.MuonWithAuxAdam)
mm.CountingNewtonSchulz.count_torch()


def _ns_calls() -> list:
    """Every rank's Newton-Schulz calls (shapes), gathered."""
    return collectives.all_gather_objects(list(mm.CountingNewtonSchulz.calls))


def exact_run(kind: str, strategy, steps: int = STEPS, precision: str = "32-true") -> dict:
    """Accumulation 2, clipping by global norm, a StepLR scheduler, two param groups; parameters against plain
    single-process PyTorch (a mixed-precision run, without accumulation, against the emulation of its arithmetic
    in ``mixed_reference.py``)."""
    L.seed_everything(7)
    module = mm.MatrixRegression(kind)
    initial = copy.deepcopy(module.state_dict())
    mm.CountingNewtonSchulz.reset()
    accumulate = ACCUMULATE if precision == "32-true" else 1
    t = trainer(
        strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
        precision=precision,
    )
    data = models.IndexedData()
    t.fit(module, models.loader(data, BATCH))
    final = t.strategy.full_state_dict()
    shards = t.strategy.engine.optimizer_shards(t.optimizers[0])
    calls = _ns_calls()
    out = {
        "steps": t.global_step,
        "ns_calls": [len(c) for c in calls],
        "imbalance": shards.owners.imbalance(),
        "owned_elements": list(shards.owners.load),
        "matrices": len(mm.matrices(module)),
        "ns_shapes": sorted({tuple(s) for c in calls for s in c}),
        "matrix_shapes": sorted({tuple(p.shape) for p in mm.matrices(module)}),
        "ranks_agree": _ranks_agree(module),
    }
    if RANK == 0 and precision == "32-true":
        ref = mm.reference(kind, initial, data, world=WORLD, batch=BATCH, steps=steps, accumulate=accumulate, clip=CLIP)
        out["param_diff"] = max_diff(final, ref)
        out["param_change"] = max_diff(ref, initial)
    elif RANK == 0:
        emulated = mixed_reference(
            initial,
            lambda: mm.MatrixRegression(kind),
            data,
            world=WORLD,
            batch=BATCH,
            steps=steps,
            clip=CLIP,
            policy=t.strategy.precision_plugin.policy(),
            hold_sum_in_param_dtype=t.strategy.stage != 3,
        )
        out["param_diff"] = max_diff(final, emulated["params"])
        out["param_change"] = max_diff(emulated["params"], initial)
    return out


def _ranks_agree(module: nn.Module) -> bool:
    """Every rank computes with the same parameters (the full tensors at stages 1-2, the gathered ones at 3)."""
    full = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float() for n, p in module.named_parameters()
    }
    parts = collectives.all_gather_objects({n: t.sum().item() for n, t in full.items()})
    return all(part == parts[0] for part in parts)


def exact(directory: Path) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for kind in ("aux_adam", "adafactor"):
            out[f"stage{stage}_{kind}"] = exact_run(kind, ZeroStrategy(stage=stage, matrix_optimizers=MATRIX))
    return out


def manual_run(strategy, muon: type) -> dict:
    L.seed_everything(11)
    module = mm.TwoOptimizers(muon)
    initial = copy.deepcopy(module.state_dict())
    mm.CountingNewtonSchulz.reset()
    t = trainer(strategy, max_steps=2 * STEPS)  # manual optimization: two optimizer steps per window
    data = models.IndexedData()
    t.fit(module, models.loader(data, BATCH))
    if isinstance(strategy, ZeroStrategy):
        final = t.strategy.full_state_dict()
    else:
        final = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out = {"ns_calls": [len(c) for c in _ns_calls()]}
    if RANK == 0:
        ref = mm.two_optimizers_reference(initial, data, muon, world=WORLD, batch=BATCH, steps=STEPS)
        out["param_diff"] = max_diff(final, ref)
        out["param_change"] = max_diff(ref, initial)
    return out


def manual(directory: Path) -> dict:
    """``torch.optim.Muon`` + ``AdamW`` in manual optimization, as a user writes it; the fp32-Newton-Schulz Muon
    exactly, torch's bf16 one against Lightning ``ddp``'s own distance from one process."""
    out = {
        f"stage{s}_fp32_muon": manual_run(ZeroStrategy(stage=s, matrix_optimizers=MATRIX), mm.FP32Muon)
        for s in (1, 2, 3)
    }
    out.update({f"stage{s}_torch_muon": manual_run(ZeroStrategy(stage=s), torch.optim.Muon) for s in (1, 2, 3)})
    out["ddp_torch_muon"] = manual_run("ddp", torch.optim.Muon)
    out["ddp_fp32_muon"] = manual_run("ddp", mm.FP32Muon)
    return out


def state_bytes(stage: int, **kwargs) -> dict:
    """Optimizer-state elements this rank holds: whole (Muon momentum, on owners) against the ownership plan, and
    element-wise (AdamW moments, on shards)."""
    L.seed_everything(7)
    module = mm.MatrixRegression("aux_adam")
    t = trainer(ZeroStrategy(stage=stage, matrix_optimizers=MATRIX, **kwargs), max_steps=2)
    t.fit(module, models.loader(models.IndexedData(), BATCH))
    optimizer = t.optimizers[0]
    shards = t.strategy.engine.optimizer_shards(optimizer)
    owners = shards.owners_of()
    hosted = shards.hosted()
    whole, sharded, devices = 0, 0, set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(hosted.get(id(p), p), {})
            tensors = [
                v.to_local() if isinstance(v, DTensor) else v for v in entry.values() if isinstance(v, torch.Tensor)
            ]
            devices.update(str(v.device) for v in tensors)
            numel = sum(v.numel() for v in tensors if v.dim() > 0)
            if id(p) in owners:
                whole += numel
            else:
                sharded += numel
    elementwise_full = sum(p.numel() for p in mm.others(module))
    return {
        "whole": collectives.all_gather_objects(whole),
        "sharded": collectives.all_gather_objects(sharded),
        "owned_elements": list(shards.owners.load),
        "matrix_elements": sum(p.numel() for p in mm.matrices(module)),
        "elementwise_elements": elementwise_full,
        "devices": sorted(devices),
        "imbalance": shards.owners.imbalance(),
    }


def resumed_equals_uninterrupted(stage: int, directory: Path, state_dict_type: str, kind: str = "aux_adam") -> dict:
    """One epoch, a checkpoint, a second epoch from it in a new Trainer: the same parameters as two epochs straight
    (an epoch boundary: Lightning restarts a plain dataloader's epoch on a mid-epoch resume)."""
    data = models.IndexedData(n=32)

    def run(epochs, ckpt_path=None, save=None):
        L.seed_everything(7)
        module = mm.MatrixRegression(kind)
        strategy = ZeroStrategy(stage=stage, matrix_optimizers=MATRIX, state_dict_type=state_dict_type)
        t = trainer(strategy, max_epochs=epochs, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP)
        t.fit(module, models.loader(data, BATCH), ckpt_path=ckpt_path)
        if save is not None:
            t.save_checkpoint(save)
        return t.strategy.full_state_dict(), t.global_step

    straight, steps = run(2)
    path = directory / f"resume_{stage}_{state_dict_type}_{kind}"
    run(1, save=path)
    resumed, resumed_steps = run(2, ckpt_path=path)
    return {"diff": max_diff(resumed, straight) if RANK == 0 else None, "steps": [steps, resumed_steps]}


class Undeclared(torch.optim.Optimizer):
    """A custom optimizer nobody vouched for."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        return None


class UndeclaredModule(models.Regression):
    def configure_optimizers(self):
        return Undeclared(self.parameters())


def refusal() -> dict:
    try:
        trainer(ZeroStrategy(stage=2), max_steps=1).fit(UndeclaredModule(), models.loader(models.IndexedData(), BATCH))
    except TypeError as err:
        return {"message": str(err)}
    return {"message": None}


def variants(directory: Path) -> dict:
    out = {}
    for stage in (2, 3):  # fp32 masters of the owned matrices; ranks agree, close to the fp32 reference
        out[f"stage{stage}_bf16"] = exact_run(
            "aux_adam", ZeroStrategy(stage=stage, matrix_optimizers=MATRIX), precision="bf16-mixed"
        )
    out["stage2_offload"] = exact_run(
        "aux_adam", ZeroStrategy(stage=2, offload_optimizer=True, matrix_optimizers=MATRIX)
    )
    out["stage3_offload_params"] = exact_run("adafactor", ZeroStrategy(stage=3, offload_params=True))
    out["stage3_offload_optimizer"] = exact_run(
        "aux_adam", ZeroStrategy(stage=3, offload_optimizer=True, matrix_optimizers=MATRIX)
    )
    out["bytes_stage2"] = state_bytes(2)
    out["bytes_stage3"] = state_bytes(3)
    out["bytes_stage2_offload"] = state_bytes(2, offload_optimizer=True)
    out["resume_stage3_sharded"] = resumed_equals_uninterrupted(3, directory, "sharded")
    out["resume_stage2_full"] = resumed_equals_uninterrupted(2, directory, "full")
    out["resume_stage1_full_adafactor"] = resumed_equals_uninterrupted(1, directory, "full", kind="adafactor")
    out["refusal"] = refusal()
    return out


def four_ranks(directory: Path) -> dict:
    """4 ranks as 2 simulated nodes: whole parameters spread over 4 owners, and hybrid sharding (owners inside
    each shard group, every replica group stepping the same matrices)."""
    return {
        "stage3_aux_adam": exact_run("aux_adam", ZeroStrategy(stage=3, matrix_optimizers=MATRIX)),
        "stage2_adafactor": exact_run("adafactor", ZeroStrategy(stage=2)),
        "stage2_hybrid_aux_adam": exact_run("aux_adam", ZeroStrategy(stage=2, shard_size=2, matrix_optimizers=MATRIX)),
        "stage3_hybrid_adafactor": exact_run("adafactor", ZeroStrategy(stage=3, shard_size=2)),
    }


def hf_models(directory: Path) -> dict:
    """Hugging Face GPT-2 (Conv1D matrices, tied embeddings) and Llama built from tiny configs, with Adafactor and a
    Muon + AdamW mix, against the same single-process run (``worker_hf_models``' harness: accumulation, clipping, a
    warmup schedule)."""
    from tests.distributed import worker_hf_models

    out = {}
    for kind in ("gpt2", "llama"):
        for optimizer in ("adafactor", "aux_adam"):
            module_cls = mm.hf_module(optimizer)
            for stage in (2, 3):
                result = worker_hf_models.run(
                    kind, stage, "32-true", False, module_cls=module_cls, matrix_optimizers=MATRIX
                )
                out[f"{kind}_{optimizer}_stage{stage}"] = result
    return out


# ---------------------------------------------------------------------- across world sizes and stages
class Epochs(mm.MatrixRegression):
    """No schedule (the resharding tests check the optimizer state itself); 16 samples: 2 steps an epoch on 2
    ranks, 4 on one."""

    def configure_optimizers(self):
        return mm.build_optimizer(self.kind, self)


CROSS_DATA = models.IndexedData(n=16)


def _cross_run(stage: int, epochs: int, directory: Path, name: str, resume: str | None) -> dict:
    L.seed_everything(7)
    module = Epochs("aux_adam")
    t = trainer(ZeroStrategy(stage=stage, matrix_optimizers=MATRIX), max_epochs=epochs)
    t.fit(module, models.loader(CROSS_DATA, BATCH), ckpt_path=None if resume is None else directory / resume)
    t.save_checkpoint(directory / name)
    optimizer = t.optimizers[0]
    model_state = t.strategy.full_state_dict()
    optim_state = state_dicts.full_optimizer_state(optimizer, t.strategy.lightning_module, t.strategy.engine)
    if RANK == 0:
        torch.save(
            {"model": model_state, "optimizer": optim_state, "epoch": t.current_epoch}, directory / f"{name}.full.pt"
        )
    return {"steps": t.global_step}


def _continued_in_one_process(directory: Path, start: str, epoch: int, world: int) -> dict:
    """Plain PyTorch from a saved full state, one epoch of ``world`` ranks' batches (as Lightning deals them)."""
    saved = torch.load(directory / f"{start}.full.pt", weights_only=True)
    model = Epochs("aux_adam")
    model.load_state_dict(saved["model"])
    opt = mm.build_optimizer("aux_adam", model)
    opt.load_state_dict(saved["optimizer"])
    for per_rank in _epoch_batches(CROSS_DATA, world, BATCH, epoch):
        opt.zero_grad()
        (sum(nn.functional.mse_loss(model(x), y) for x, y in per_rank) / world).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _epoch_batches(dataset, world: int, batch: int, epoch: int) -> list:
    """Epoch ``epoch``'s global micro-batches over ``world`` ranks."""
    per_epoch = len(dataset) // (world * batch)
    return models.global_microbatches(dataset, world, batch, per_epoch * (epoch + 1))[per_epoch * epoch :]


def save_s2(directory: Path) -> dict:
    """Stage 2 on 2 ranks: one epoch, then a sharded checkpoint (and its full state, for the reference)."""
    return _cross_run(2, 1, directory, "s2", None)


def resume_s3(directory: Path) -> dict:
    """Stage 3 on 1 rank resumes the stage-2 checkpoint for one epoch, against plain PyTorch from its state."""
    out = _cross_run(3, 2, directory, "s3", "s2")
    saved = torch.load(directory / "s3.full.pt", weights_only=True)
    ref = _continued_in_one_process(directory, "s2", 1, WORLD)
    out["diff"] = max_diff(saved["model"], ref)
    out["whole_state_keys"] = sorted(k for k, v in saved["optimizer"]["state"].items() if "momentum_buffer" in v)
    # `lightning-zero consolidate --optimizer` of the 2-rank directory: the torch.optim state the run held.
    consolidated = torch.load(
        consolidate(directory / "s2", directory / "s2.consolidated.pt", include_optimizer=True), weights_only=True
    )["optimizer_states"][0]["state"]
    held = torch.load(directory / "s2.full.pt", weights_only=True)["optimizer"]["state"]
    out["consolidated_keys_equal"] = sorted(consolidated) == sorted(held)
    out["consolidated_diff"] = max(
        (consolidated[i][k] - v).abs().max().item()
        for i, entry in held.items()
        for k, v in entry.items()
        if v.dim() > 0
    )
    return out


def resume_s2(directory: Path) -> dict:
    """And back: stage 2 on 2 ranks resumes the 1-rank stage-3 checkpoint."""
    out = _cross_run(2, 3, directory, "s2b", "s3")
    if RANK == 0:
        saved = torch.load(directory / "s2b.full.pt", weights_only=True)
        out["diff"] = max_diff(saved["model"], _continued_in_one_process(directory, "s3", 2, WORLD))
    return out


CASES = {
    "exact": exact,
    "manual": manual,
    "variants": variants,
    "four_ranks": four_ranks,
    "hf": hf_models,
    "save_s2": save_s2,
    "resume_s3": resume_s3,
    "resume_s2": resume_s2,
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
