"""Rank program for test_engine_contract.py: each sharding engine driven through ``engine/api.py`` alone, by a
plain ``torch.distributed`` loop on 2 gloo processes, no Lightning. Accumulation of 2 micro-batches (the first
under ``no_sync``), clipping by the global norm from the disjoint gradient shards, 2 param groups and a warmup
schedule, 3 steps; against the same steps in one process on the global batches."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine.api import OptimizerShards, ShardingEngine
from lightning_zero.engine.stage3.fsdp2 import FullyShardedEngine
from lightning_zero.engine.stage12.zero_dp import ZeroDataParallel
from lightning_zero.engine.state_dict import gather_full
from tests.launch import ensure_process_group, run_cases

STEPS, ACCUMULATE, BATCH, CLIP = 3, 2, 4, 0.05


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def micro_batches(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per optimizer step and micro-batch, every rank's (x, y)."""
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(world)]
        for _ in range(STEPS * ACCUMULATE)
    ]


def optimizer_for(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def reference(world: int) -> dict[str, torch.Tensor]:
    model = build()
    optimizer, scheduler = optimizer_for(model)
    batches = micro_batches(world)
    for step in range(STEPS):
        for micro in batches[step * ACCUMULATE : (step + 1) * ACCUMULATE]:
            loss = sum(nn.functional.mse_loss(model(x), y) for x, y in micro) / world
            (loss / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def clip_by_global_norm(shards: OptimizerShards, clip: float) -> None:
    grads = shards.local_gradients()
    squares = torch.zeros((), dtype=torch.float64)
    for g in grads:
        squares += g.double().pow(2).sum()
    dist.all_reduce(squares)
    coef = min(1.0, clip / (float(squares.sqrt()) + 1e-6))
    torch._foreach_mul_(grads, coef)


def make_engine(stage: int, model: nn.Module) -> ShardingEngine:
    if stage == 3:
        return FullyShardedEngine(model, device=torch.device("cpu"))
    return ZeroDataParallel(model, stage=stage, bucket_numel=64)  # several buckets for 163 parameters


def train(stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    engine = make_engine(stage, model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer, scheduler = optimizer_for(model)
    names = {id(p): n for n, p in model.named_parameters()}
    in_groups = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    engine.wrap_optimizer(optimizer)
    shards = engine.optimizer_shards(optimizer)
    batches = micro_batches(world)
    for step in range(STEPS):
        engine.discard_all_gradients()
        for index, micro in enumerate(batches[step * ACCUMULATE : (step + 1) * ACCUMULATE]):
            last = index == ACCUMULATE - 1
            with contextlib.nullcontext() if last else engine.no_sync():
                x, y = micro[rank]
                (nn.functional.mse_loss(model(x), y) / ACCUMULATE).backward()
        engine.post_backward()
        shards.finalize_gradients(1.0)
        clip_by_global_norm(shards, CLIP)
        shards.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    records = engine.records()
    final = {r.name: gather_full(r.rows, r.shape, group=r.group) for r in records}
    expected = reference(world)
    chunk_rows = {
        r.name: (r.rows.shape[0] if len(r.shape) else None, -(-r.shape[0] // world) if len(r.shape) else None)
        for r in records
    }
    out = {
        "names": [r.name for r in records] == trainable,
        "optimizer_names": [r.name for r in shards.records()] == in_groups,
        "protocols": isinstance(engine, ShardingEngine) and isinstance(shards, OptimizerShards),
        "rows_are_chunks": all(got <= most for got, most in chunk_rows.values() if got is not None),
        "diff": max(float((final[n] - expected[n]).abs().max()) for n in expected),
        "change": max(float((expected[n] - p.detach()).abs().max()) for n, p in build().named_parameters()),
    }
    engine.teardown()
    return out


CASES = {f"stage{stage}": (lambda stage=stage: train(stage)) for stage in (1, 2, 3)}


if __name__ == "__main__":
    ensure_process_group()
    run_cases(CASES, sys.argv[1:])
