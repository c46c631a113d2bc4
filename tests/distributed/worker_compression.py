"""Rank program for communication compression (pattern: worker_core; 2 ranks, or 4 as 2 simulated nodes)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.demo.gpt import GPTLightningModule
from lightning_zero.engine.comm import collectives, flight
from tests.distributed import models, worker_checkpoint, worker_precision
from tests.distributed.worker_core import NODES, RANK, CommProbe, exactness, max_diff, trainer
from tests.launch import run_cases_with_directory

HYBRID = "node" if NODES > 1 else 2

MODES = {
    "off": {},
    "fp16": dict(gradient_compression="fp16", param_compression="fp16"),
    "int8": dict(gradient_compression="int8"),
    "int8_ef": dict(gradient_compression="int8", error_feedback=True),
    "int4_ef_asymmetric": dict(gradient_compression="int4", error_feedback=True, quantization_scheme="asymmetric"),
    "qwz_int8": dict(gradient_compression="int8", error_feedback=True, param_compression="int8"),
}


class Recorder(L.Callback):
    """Each step's loss, and the first block's attention weight as forward saw it (gathered and decoded at stage
    3), on every rank."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.seen: torch.Tensor | None = None

    def on_fit_start(self, trainer, pl_module):
        def grab(module, args):
            self.seen = module.c_attn.weight.detach().clone()

        pl_module.model.blocks[0].attn.register_forward_pre_hook(grab)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def gpt(stage: int, precision: str = "32-true", steps: int = 12, **kwargs) -> dict:
    """The demo GPT under ``kwargs``: losses, the final full parameters (rank 0) and how far the weights forward
    used differ between ranks."""
    L.seed_everything(11)
    module = GPTLightningModule(**worker_precision.GPT_KWARGS)
    recorder = Recorder()
    t = trainer(
        ZeroStrategy(stage=stage, **kwargs),
        max_steps=steps,
        gradient_clip_val=worker_precision.CLIP,
        callbacks=[recorder],
        **worker_precision.precision_kwargs(precision),
    )
    t.fit(module, models.loader(worker_precision.gpt_data(), worker_precision.BATCH))
    seen = collectives.all_gather_objects(recorder.seen.float())
    full = t.strategy.full_state_dict()
    return {
        "losses": recorder.losses,
        "steps": t.global_step,
        "params": full if RANK == 0 else None,
        "ranks_differ_by": max(float((s - seen[0]).abs().max()) for s in seen),
    }


def modes(stage: int, precision: str = "32-true", names=tuple(MODES), **extra) -> dict:
    """Every mode against the uncompressed run: identical weights on every rank, a loss curve that tracks."""
    plain = {k: v for k, v in extra.items() if k != "compression_scope"}  # a scope needs something to compress
    runs = {name: gpt(stage, precision, **MODES[name], **(extra if MODES[name] else plain)) for name in names}
    off = runs["off"] if "off" in runs else gpt(stage, precision, **plain)
    out = {}
    for name, run in runs.items():
        out[name] = {
            "steps": run["steps"],
            "ranks_differ_by": run["ranks_differ_by"],
            "losses": run["losses"],
            "off_losses": off["losses"],
            "param_diff_vs_off": max_diff(run["params"], off["params"]) if RANK == 0 else None,
        }
    return out


def settings_without_compression_change_nothing(stage: int) -> dict:
    """Compression settings that compress nothing (no wire format) leave a run bit for bit as it was."""
    plain = gpt(stage, steps=6)
    inert = gpt(stage, steps=6, quantization_scheme="asymmetric", quantization_block_size=64)
    return {
        "diff": max_diff(plain["params"], inert["params"]) if RANK == 0 else None,
        "loss_diff": max(abs(a - b) for a, b in zip(plain["losses"], inert["losses"])),
    }


class UnitProbe(CommProbe):
    """Also the kind and unit of each collective the flight recorder holds at the end of each micro-batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.units = [(op.kind, op.unit) for op in flight.RECORDER.recent_ops()]


def communication(stage: int, **kwargs) -> dict:
    """Bytes per kind and group on the first micro-batch (no accumulation), the layout they follow, and the units
    the flight recorder names for the last micro-batch's collectives."""
    L.seed_everything(0)
    module = models.Wide(width=64, depth=3)
    probe = UnitProbe()
    t = trainer(ZeroStrategy(stage=stage, **kwargs), max_steps=2, callbacks=[probe])
    t.fit(module, models.loader(models.WideData(module.width), 4))
    engine = t.strategy.engine
    layout = getattr(engine, "layout", None)
    return {
        "micro": probe.micro,
        "params": sum(p.numel() for p in module.parameters()),
        "segments": [b.segment_numel for b in layout.buckets] if layout is not None else None,
        "shard_size": engine.world_size,
        "units": probe.units,
    }


def exact_when_off(stage: int) -> dict:
    """The exactness harness of worker_core with compression settings that compress nothing."""
    strategy = ZeroStrategy(stage=stage, state_dict_type="full", quantization_scheme="asymmetric")
    return exactness(stage, strategy=strategy)


def checkpoint_resume(directory: Path, stage: int, **kwargs) -> dict:
    """Error feedback's residuals travel with a sharded checkpoint: a run interrupted and resumed ends where an
    uninterrupted one does, bit for bit."""
    ref_params, ref_optim = worker_checkpoint.straight(stage, **kwargs)
    params, optim, steps = worker_checkpoint.interrupted(
        stage, stage, directory, save_kwargs=kwargs, resume_kwargs=kwargs
    )
    return {
        "steps": steps,
        "param_diff": worker_checkpoint.max_diff(params, ref_params) if RANK == 0 else None,
        "optim_diff": worker_checkpoint.optim_diff(optim, ref_optim) if RANK == 0 else None,
    }


CASES = {
    "main": lambda directory: {
        # every mode at stage 2; at stages 1 and 3 the modes whose wire format differs there (stage 3 gathers
        # weights, in fp16 or int8); the rest of each stage in "full"
        "stage1": modes(1, names=("off", "int8_ef")),
        "stage2": modes(2),
        "stage3": modes(3, names=("off", "fp16", "qwz_int8")),
        "stage2_bf16-mixed": modes(2, "bf16-mixed", names=("off", "int8_ef")),
        "inert_stage2": settings_without_compression_change_nothing(2),
        **{f"comm_stage{s}_{m}": communication(s, **MODES[m]) for s in (2, 3) for m in ("off", "fp16", "int8")},
        "comm_stage3_qwz": communication(3, **MODES["qwz_int8"]),
        "resume_stage2": checkpoint_resume(directory / "resume2", 2, **MODES["int8_ef"]),
        "resume_stage3": checkpoint_resume(directory / "resume3", 3, **MODES["qwz_int8"]),
    },
    "full": lambda directory: {
        "stage1_full": modes(1, names=tuple(MODES)),
        "stage3_full": modes(3, names=("off", "int8", "int8_ef", "int4_ef_asymmetric")),
        "stage2_bf16-mixed_qwz": modes(2, "bf16-mixed", names=("off", "qwz_int8")),
        "stage3_bf16-mixed": modes(3, "bf16-mixed", names=("off", "int8_ef", "qwz_int8")),
        **{f"exact_off_stage{s}": exact_when_off(s) for s in (1, 2, 3)},
        "stage2_offload": modes(2, names=("off", "int8_ef"), offload_optimizer=True),
        "stage2_no_overlap": modes(2, names=("off", "int8_ef"), overlap_comm=False),
        "stage2_16-mixed": modes(2, "16-mixed", names=("off", "int8_ef", "qwz_int8")),
    },
    "hybrid": lambda directory: {
        "stage2_inter_node": modes(2, names=("off", "int8_ef"), shard_size=HYBRID, compression_scope="inter_node"),
        "stage3_all": modes(3, names=("off", "int8_ef"), shard_size=HYBRID),
        **{
            f"comm_stage{s}_{scope}": communication(s, shard_size=HYBRID, compression_scope=scope, **MODES["int8"])
            for s in (2, 3)
            for scope in ("all", "inter_node")
        },
        **{f"comm_stage{s}_off": communication(s, shard_size=HYBRID) for s in (2, 3)},
    },
    "hybrid_full": lambda directory: {
        "stage2_all": modes(2, names=("off", "int8_ef"), shard_size=HYBRID),
        "stage3_inter_node": modes(3, names=("off", "int8_ef"), shard_size=HYBRID, compression_scope="inter_node"),
        "stage3_hpz": modes(3, names=("off", "qwz_int8"), secondary_shard_size=HYBRID),
    },
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
