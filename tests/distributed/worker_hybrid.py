"""Rank program for hybrid sharding and hpZ: 4 ranks, as 2 simulated nodes of 2 (``launch(..., nodes=2)``) or as
one node of 4 (pattern: worker_core; checkpoints as worker_checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.memory import live_tensor_bytes
from lightning_zero.monitor import ZeroMonitor
from tests.distributed import models, worker_checkpoint
from tests.distributed.worker_core import NODES, RANK, CommProbe, StateBytesProbe, exactness, trainer
from tests.launch import run_cases_with_directory

HYBRID = "node" if NODES > 1 else 2  # a node's ranks, or 2 of the one node's 4


def exact(stage: int, unused_head: bool = False, **kwargs) -> dict:
    strategy = ZeroStrategy(stage=stage, state_dict_type="full", **kwargs)
    return exactness(stage, strategy=strategy, unused_head=unused_head)


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
    return {"bytes": probe.bytes, "after_forward": forward.bytes, "params": params,
            "shard_size": t.strategy.engine.world_size}


def checkpoints(directory: Path) -> dict:
    """Exact resume across flat/hybrid, shard sizes and stages (4 ranks); then a hybrid save for another world."""
    out = {}
    pairs = [((2, {"shard_size": HYBRID}), (3, {})), ((1, {}), (3, {"shard_size": HYBRID})),
             ((3, {"shard_size": HYBRID}), (1, {"shard_size": HYBRID})), ((3, {"secondary_shard_size": 2}), (2, {"shard_size": 2}))]
    for (save_stage, save_kwargs), (resume_stage, resume_kwargs) in pairs:
        name = f"{save_stage}{save_kwargs}->{resume_stage}{resume_kwargs}"
        ref_params, ref_optim = worker_checkpoint.straight(resume_stage, **resume_kwargs)
        params, optim, steps = worker_checkpoint.interrupted(
            save_stage, resume_stage, directory / str(len(out)), save_kwargs=save_kwargs, resume_kwargs=resume_kwargs
        )
        if RANK == 0:
            out[name] = {"steps": steps, "param_diff": worker_checkpoint.max_diff(params, ref_params),
                         "optim_diff": worker_checkpoint.optim_diff(optim, ref_optim)}
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


CASES = {
    "exact": lambda directory: {
        **{f"stage{s}": exact(s, shard_size=HYBRID) for s in (1, 2, 3)},
        "stage3_hpz": exact(3, secondary_shard_size=HYBRID),
        "stage2_unused_parameter": exact(2, shard_size=HYBRID, unused_head=True),
    },
    "exact_one_node": lambda directory: {f"stage{s}": exact(s, shard_size=HYBRID) for s in (1, 2, 3)},
    "exact_full": lambda directory: {
        "stage1_no_overlap": exact(1, shard_size=HYBRID, overlap_comm=False),
        "stage2_reduce_every_microbatch": exact(2, shard_size=HYBRID, reduce_every_microbatch=True),
        "stage3_unused_parameter": exact(3, shard_size=HYBRID, unused_head=True),
    },
    "costs": lambda directory: {
        **{f"comm_stage{s}": communication(s, shard_size=HYBRID) for s in (1, 2, 3)},
        "comm_stage2_flat": communication(2),
        "comm_stage3_hpz": communication(3, secondary_shard_size=HYBRID),
        **{f"memory_stage{s}": memory(s, shard_size=HYBRID) for s in (1, 2, 3)},
        "memory_stage3_flat": memory(3),
        "memory_stage3_hpz": memory(3, secondary_shard_size=HYBRID),
    },
    "checkpoints": checkpoints,
    "directory_bytes": directory_bytes,
    # Another world size (through tests/distributed/worker_checkpoint): one process saves flat and a hybrid run of 4
    # resumes from it; the hybrid run saves and one process resumes from that.
    "save_flat": lambda directory: worker_checkpoint.save_for_other_world(directory / "flat"),
    "resume_flat_save": lambda directory: worker_checkpoint.resume_in_other_world(directory / "flat", shard_size=HYBRID),
    "save_hybrid": lambda directory: worker_checkpoint.save_for_other_world(directory / "hybrid", shard_size=HYBRID),
    "resume_hybrid_save": lambda directory: worker_checkpoint.resume_in_other_world(directory / "hybrid"),
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
