"""Rank program for tests/distributed/test_pipeline.py: one pipeline over the ranks, each schedule against an
unsplit single-process reference on the same batches (same init, AdamW, 3 steps)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.pipeline import PipelineLayout, PipelineRunner, split_bounds
from tests.launch import ensure_process_group, run_cases

STEPS, BATCH, MICROBATCHES = 3, 8, 4


def build() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(6)]
    return nn.Sequential(nn.Linear(8, 16), *blocks, nn.LayerNorm(16), nn.Linear(16, 3))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(STEPS)]


def reference() -> tuple[nn.Sequential, list[float]]:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches():
        # the mean of the micro-batch losses, as the schedule computes it
        loss = (
            sum(loss_fn(model(xm), ym) for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))) / MICROBATCHES
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return model, losses


def run_schedule(schedule: str, virtual: int, split: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    names = {id(p): n for n, p in model.named_parameters()}
    layout = PipelineLayout(world, world, virtual)
    bounds = split_bounds(model, layout.num_stages, split)
    runner = PipelineRunner(list(model), bounds, layout, rank, torch.device("cpu"), MICROBATCHES, schedule, loss_fn)
    optimizer = torch.optim.AdamW(list(runner.parameters()), lr=1e-2)
    losses = []
    for x, y in batches():
        loss = runner.step(x, y)
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:
            losses.append(float(loss))
    expected, expected_losses = reference()
    wanted = dict(expected.named_parameters())
    held = {names[id(p)]: p for p in runner.parameters()}  # the unsplit model's names
    diff = max(float((p - wanted[n]).abs().max()) for n, p in held.items())
    held_names = [None] * world
    dist.all_gather_object(held_names, sorted(held))
    diffs = [None] * world
    dist.all_gather_object(diffs, diff)
    last_losses = [None] * world
    dist.all_gather_object(last_losses, losses)
    x, y = batches()[0]
    val = runner.evaluate(x, y)
    vals = [None] * world
    dist.all_gather_object(vals, None if val is None else float(val))
    with torch.no_grad():
        expected_val = float(
            sum(loss_fn(expected(xm), ym) for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)))
            / MICROBATCHES
        )
    return {
        "bounds": bounds,
        "param_diff": max(diffs),
        "names_cover_model": sorted(n for names_ in held_names for n in names_) == sorted(wanted),
        "names_disjoint": sum(len(n) for n in held_names) == len(wanted),
        "losses": next(loss for loss in last_losses if loss),
        "reference_losses": expected_losses,
        "eval_loss": next(v for v in vals if v is not None),
        "reference_eval_loss": expected_val,
    }


def cases() -> dict:
    return {
        "gpipe": lambda: run_schedule("gpipe", 1, "layers"),
        "1f1b": lambda: run_schedule("1f1b", 1, "params"),
        "interleaved": lambda: run_schedule("interleaved_1f1b", 2, "layers"),
    }


if __name__ == "__main__":
    ensure_process_group()
    run_cases(cases(), sys.argv[1:])
