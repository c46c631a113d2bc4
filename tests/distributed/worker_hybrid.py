"""Rank program for hybrid sharding and hpZ: 4 ranks, as 2 simulated nodes of 2 (``launch(..., nodes=2)``) or as
one node of 4 (pattern: worker_core; checkpoints as worker_checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.demo.gpt import GPTLightningModule
from lightning_zero.observability.monitor import ZeroMonitor
from lightning_zero.planning.accounting import live_tensor_bytes
from tests.distributed import (
    memory_layouts,
    models,
    worker_checkpoint,
    worker_edges,
    worker_hf_models,
    worker_precision,
    worker_pretrained,
)
from tests.distributed.grad_norm_probe import GradNormAgainstGathered
from tests.distributed.worker_core import NODES, RANK, CommProbe, StateBytesProbe, exactness, max_diff, trainer
from tests.launch import run_cases_with_directory

HYBRID = "node" if NODES > 1 else 2  # a node's ranks, or 2 of the one node's 4


def exact(stage: int, unused_head: bool = False, validate_first: bool = False, **kwargs) -> dict:
    strategy = ZeroStrategy(stage=stage, state_dict_type="full", **kwargs)
    return exactness(stage, strategy=strategy, unused_head=unused_head, validate_first=validate_first)


def gradient_norms(stage: int, **kwargs) -> dict:
    """``lightning_zero.grad_norm`` with rows spread over a shard group and its replicas, under accumulation."""
    L.seed_everything(3)
    check = GradNormAgainstGathered()
    t = trainer(ZeroStrategy(stage=stage, **kwargs), max_steps=2, accumulate_grad_batches=2, callbacks=[check])
    t.fit(GPTLightningModule(**worker_precision.GPT_KWARGS), models.loader(worker_precision.gpt_data(), 2))
    return check.report()


def _shard_numel(module: torch.nn.Module, k: int) -> int:
    """Elements of this rank's dim-0 chunks of the trainable parameters (rank 0: the first chunk)."""
    return sum(-(-p.shape[0] // k) * (p.numel() // p.shape[0]) for p in module.parameters() if p.requires_grad)


def communication(stage: int, **kwargs) -> dict:
    """Elements per micro-batch, split by group and intra/inter-node (no clipping, no accumulation)."""
    L.seed_everything(0)
    module = models.Wide(width=64, depth=3)
    probe, monitor = CommProbe(), ZeroMonitor(log_every_n_steps=1, prog_bar=False)
    t = trainer(ZeroStrategy(stage=stage, **kwargs), max_steps=2, callbacks=[probe, monitor])
    t.fit(module, models.loader(models.WideData(module.width), 4))
    engine = t.strategy.engine
    return {
        "micro": probe.micro,
        "monitor_inter_node_MiB": monitor.last["monitor/comm_inter_node_MiB"],
        "monitor_MiB": monitor.last["monitor/comm_MiB_per_step"],
        "params": sum(p.numel() for p in module.parameters()),
        "tensors": len(list(module.parameters())),
        "shard_numel": _shard_numel(module, engine.world_size),
        "shard_size": engine.world_size,
    }


def gpt_communication(**kwargs) -> dict:
    """Elements of the last micro-batch by group for the demo GPT (tied embedding and head outside the blocks,
    a ``training_step`` that calls ``self(...)``, so the root's forward hooks run nested)."""
    L.seed_everything(0)
    module = GPTLightningModule(**{**worker_precision.GPT_KWARGS, "tie_weights": True})
    probe = CommProbe()
    t = trainer(ZeroStrategy(stage=3, **kwargs), max_steps=2, callbacks=[probe])
    t.fit(module, models.loader(worker_precision.gpt_data(), 2))
    return {
        "micro": probe.micro,
        "params": sum(p.numel() for p in module.parameters()),
        "tensors": len(list(module.parameters())),
    }


class AfterForward(L.Callback):
    """Bytes of live tensors between forward and backward (hpZ keeps its node-local copy there)."""

    def __init__(self) -> None:
        self.bytes = None

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == 1 and self.bytes is None:
            self.bytes = live_tensor_bytes()


def memory(stage: int, **kwargs) -> dict:
    L.seed_everything(0)
    module = models.Wide()
    params = sum(p.numel() for p in module.parameters())
    probe, forward = StateBytesProbe(at_step=2), AfterForward()
    t = trainer(ZeroStrategy(stage=stage, **kwargs), max_steps=3, callbacks=[probe, forward])
    t.fit(module, models.loader(models.WideData(module.width), 8))
    return {
        "bytes": probe.bytes,
        "after_forward": forward.bytes,
        "params": params,
        "shard_size": t.strategy.engine.world_size,
    }


#: Exact resume across flat/hybrid, shard sizes and stages (4 ranks): `make test`'s pairs, then `make test-all`'s.
CHECKPOINT_PAIRS = [
    ((3, {"shard_size": HYBRID}), (1, {"shard_size": HYBRID})),
    ((3, {"secondary_shard_size": 2}), (2, {"shard_size": 2})),
]
CHECKPOINT_PAIRS_FULL = [((2, {"shard_size": HYBRID}), (3, {})), ((1, {}), (3, {"shard_size": HYBRID}))]


def checkpoints(directory: Path, pairs=CHECKPOINT_PAIRS) -> dict:
    """Each pair: a run saved at the first stage and sharding, resumed at the second, against an uninterrupted one."""
    out = {}
    for (save_stage, save_kwargs), (resume_stage, resume_kwargs) in pairs:
        name = f"{save_stage}{save_kwargs}->{resume_stage}{resume_kwargs}"
        ref_params, ref_optim = worker_checkpoint.straight(resume_stage, **resume_kwargs)
        params, optim, steps = worker_checkpoint.interrupted(
            save_stage, resume_stage, directory / str(len(out)), save_kwargs=save_kwargs, resume_kwargs=resume_kwargs
        )
        if RANK == 0:
            out[name] = {
                "steps": steps,
                "param_diff": worker_checkpoint.max_diff(params, ref_params),
                "optim_diff": worker_checkpoint.optim_diff(optim, ref_optim),
                **worker_checkpoint.optim_scale(ref_optim),
            }
    return out


def directory_bytes(directory: Path) -> dict:
    """Bytes of a sharded checkpoint's files, flat and hybrid: a hybrid run writes each row once, not once per
    replica group."""
    out = {}
    for name, kwargs in (("flat", {}), ("hybrid", {"shard_size": HYBRID})):
        for stage in (2, 3):
            L.seed_everything(7)
            t = trainer(ZeroStrategy(stage=stage, **kwargs), max_steps=1)
            t.fit(models.Wide(width=64, depth=3), models.loader(models.WideData(64), 4))
            path = directory / f"{name}{stage}"
            t.save_checkpoint(path)
            out[f"{name}{stage}"] = sum(f.stat().st_size for f in path.rglob("*.distcp"))
    return out


def groups_kept(directory: Path) -> dict:
    """Fits one after another in one process (a sweep) at stages 3 and 2 with hybrid sharding and asynchronous
    saves: the process groups alive after each (a new group adds gloo threads that take CPU even when idle)."""
    counts = []
    for stage in (3, 2, 3):
        saves = ModelCheckpoint(dirpath=directory / f"sweep{len(counts)}", every_n_train_steps=1)
        t = trainer(
            ZeroStrategy(stage=stage, shard_size=HYBRID, async_save=True),
            max_steps=1,
            callbacks=[saves],
            enable_checkpointing=True,
        )
        t.fit(models.Wide(width=16, depth=2), models.loader(models.WideData(16), 4))
        counts.append(len(dist.distributed_c10d._world.pg_map))
    return {"groups": counts}


def mixed(stage: int, precision: str, **kwargs) -> dict:
    """The demo GPT for 20 steps in a mixed precision: the masters of a single-process emulation that sums
    inside each shard group, then across the groups (``mixed_reference.py``); the loss curve of fp32."""
    return worker_precision.tracks_reference(stage, precision, **kwargs)


def hpz_equals_flat(precision: str) -> dict:
    """hpZ changes where backward gathers parameters from, not what is gathered or how gradients are reduced:
    the demo GPT ends bit for bit where flat ZeRO-3 on the same ranks ends (mixed precision: 2-byte gathers and
    sums)."""
    finals = []
    for kwargs in ({}, {"secondary_shard_size": HYBRID}):
        L.seed_everything(11)
        module = GPTLightningModule(**worker_precision.GPT_KWARGS)
        t = trainer(
            ZeroStrategy(stage=3, **kwargs),
            max_steps=10,
            gradient_clip_val=worker_precision.CLIP,
            **worker_precision.precision_kwargs(precision),
        )
        t.fit(module, models.loader(worker_precision.gpt_data(), worker_precision.BATCH))
        finals.append(t.strategy.full_state_dict())
    return {"steps": t.global_step, "diff": max_diff(*finals) if RANK == 0 else None}


def hugging_face(kind: str, stage: int, precision: str, **kwargs) -> dict:
    """A Hugging Face model (GPT-2: tied input and output embeddings) against plain PyTorch (fp32, activation
    checkpointing on) or the mixed emulation (bf16-mixed)."""
    return worker_hf_models.run(kind, stage, precision, checkpointing=precision == "32-true", **kwargs)


CASES = {
    "exact": lambda directory: {
        **{f"stage{s}": exact(s, shard_size=HYBRID) for s in (2, 3)},
        # validated first: the sanity check leaves every unit on its node-local shard as the first window opens
        "stage3_hpz": exact(3, secondary_shard_size=HYBRID, validate_first=True),
        # a head computing with the embedding's weight: hpZ's units below the root leave that layer in the root
        "stage3_hpz_tied_head": worker_edges.against_ddp(
            memory_layouts.TiedHeadReadDirectly,
            {"hpz": (dict(stage=3, secondary_shard_size=HYBRID), 0.5)},
            accumulate=1,
        ).get("hpz"),
        "stage3_bf16-mixed": mixed(3, "bf16-mixed", shard_size=HYBRID),
        "gpt2_stage3_bf16-mixed": hugging_face("gpt2", 3, "bf16-mixed", shard_size=HYBRID),
        "grad_norms_stage2": gradient_norms(2, shard_size=HYBRID),
        "groups_kept": groups_kept(directory),
    },
    "exact_one_node": lambda directory: {f"stage{s}": exact(s, shard_size=HYBRID) for s in (1, 2, 3)},
    "exact_full": lambda directory: {
        "stage1": exact(1, shard_size=HYBRID),
        "stage2_unused_parameter": exact(2, shard_size=HYBRID, unused_head=True),
        "stage1_16-mixed": mixed(1, "16-mixed", shard_size=HYBRID),
        "stage2_bf16-mixed": mixed(2, "bf16-mixed", shard_size=HYBRID),
        "gpt2_stage2_32-true": hugging_face("gpt2", 2, "32-true", shard_size=HYBRID),
        "stage1_no_overlap": exact(1, shard_size=HYBRID, overlap_comm=False),
        "stage2_reduce_every_microbatch": exact(2, shard_size=HYBRID, reduce_every_microbatch=True),
        "stage3_unused_parameter": exact(3, shard_size=HYBRID, unused_head=True),
        "stage2_offload_optimizer": exact(2, shard_size=HYBRID, offload_optimizer=True),
        "stage3_offload_params": exact(3, shard_size=HYBRID, offload_optimizer=True, offload_params=True),
        "stage3_hpz_offload_params": exact(3, secondary_shard_size=HYBRID, offload_optimizer=True, offload_params=True),
        "stage1_bf16-mixed": mixed(1, "bf16-mixed", shard_size=HYBRID),
        **{f"stage{s}_16-mixed": mixed(s, "16-mixed", shard_size=HYBRID) for s in (2, 3)},
        "stage3_hpz_bf16-mixed_vs_flat": hpz_equals_flat("bf16-mixed"),
        **{
            f"{kind}_stage{s}_32-true": hugging_face(kind, s, "32-true", shard_size=HYBRID)
            for kind in ("gpt2", "llama")
            for s in (1, 3)
        },
        "llama_stage3_hpz_32-true": hugging_face("llama", 3, "32-true", secondary_shard_size=HYBRID),
    },
    "costs": lambda directory: {
        **{f"comm_stage{s}": communication(s, shard_size=HYBRID) for s in (2, 3)},
        "comm_stage2_flat": communication(2),
        "comm_stage3_hpz": communication(3, secondary_shard_size=HYBRID),
        "memory_stage3": memory(3, shard_size=HYBRID),
        "memory_stage3_flat": memory(3),
        "memory_stage3_hpz": memory(3, secondary_shard_size=HYBRID),
    },
    "costs_full": lambda directory: {
        "comm_gpt_hpz": gpt_communication(secondary_shard_size=HYBRID),
        "comm_stage1": communication(1, shard_size=HYBRID),
        "comm_stage2_flat": communication(2),
        **{f"memory_stage{s}": memory(s, shard_size=HYBRID) for s in (1, 2)},
    },
    "checkpoints": checkpoints,
    "checkpoints_full": lambda directory: checkpoints(directory / "full", CHECKPOINT_PAIRS_FULL),
    # Pretrained GPT-2 weights (files the test writes first) into a hybrid run: each rank reads its shard group's rows.
    "pretrained": lambda directory: {
        f"stage{s}": worker_pretrained.load(directory / "pretrained", s, "single", shard_size=HYBRID) for s in (2, 3)
    },
    "directory_bytes": directory_bytes,
    # Another world size (through tests/distributed/worker_checkpoint): one process saves flat and a hybrid run of 4
    # resumes from it; the hybrid run saves and one process resumes from that.
    "save_flat": lambda directory: worker_checkpoint.save_for_other_world(directory / "flat"),
    "resume_flat_save": lambda directory: worker_checkpoint.resume_in_other_world(
        directory / "flat", shard_size=HYBRID
    ),
    "save_hybrid": lambda directory: worker_checkpoint.save_for_other_world(directory / "hybrid", shard_size=HYBRID),
    "resume_hybrid_save": lambda directory: worker_checkpoint.resume_in_other_world(directory / "hybrid"),
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
