"""Pipeline bubble: measured idle share of a pipelined step against ``(p - 1) / (m + p - 1)``.

    python benchmarks/bench_pipeline.py                       # 2 stages, m = 4, 8, 16, gpipe and 1f1b
    python benchmarks/bench_pipeline.py --microbatches 4,8 --schedules 1f1b --steps 3

Two CPU ranks (gloo, one thread each) run one pipeline of two equal stages (``--blocks`` identical MLP
blocks each) through :class:`lightning_zero.pipeline.PipelineRunner`, i.e. ``torch.distributed.pipelining``.
For each rank:

* ``step``: the wall time of a pipelined training step (forward, loss, backward of m micro-batches);
* ``busy``: the CPU time the rank's main thread spent in that step (``time.thread_time``). The stage
  computes on that thread (one intra-op thread per rank), while waiting for the other stage blocks it
  without using CPU (gloo's transfers run on gloo's own threads);
* measured bubble, per step ``1 - busy / step`` of the busiest rank (the critical path: a lighter stage
  also waits for the heavier one, which the formula, assuming equal stages, does not count), the step being
  the slower rank's wall time, then the median over the steps: the share of the step the pipeline's
  bottleneck was not computing (waiting for the other stage, the transfers, and, on a loaded machine,
  waiting for a core).

With equal stages the schedules' idle share is ``(p - 1) / (m + p - 1)``: 0.200, 0.111 and 0.059 for
m = 4, 8, 16 on 2 stages. Rank 0 prints one JSON line per (schedule, m) and then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from lightning_zero.pipeline import PipelineLayout, PipelineRunner, bubble_fraction  # noqa: E402


def build(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(2 * blocks)))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def run_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = build(args.width, args.blocks)
        layers = list(model)
        bounds = [0, args.blocks, 2 * args.blocks]
        rows = []
        for schedule in args.schedules:
            for m in args.microbatches:
                layout = PipelineLayout(2, 2)
                runner = PipelineRunner(layers, bounds, layout, rank, torch.device("cpu"), m, schedule, mse)
                batch = args.microbatch_size * m
                g = torch.Generator().manual_seed(1)
                x = torch.randn(batch, args.width, generator=g)
                y = torch.randn(batch, args.width, generator=g)
                walls, busys = [], []
                for i in range(args.warmup + args.steps):
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.thread_time()
                    runner.step(x, y)
                    dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                    for p in runner.parameters():
                        p.grad = None
                    if i >= args.warmup:
                        walls.append(dt)
                        busys.append(dc)
                mine = {"rank": rank, "walls": walls, "busys": busys, "step_s": statistics.median(walls),
                        "busy_s": statistics.median(busys)}
                ranks = [None, None]
                dist.all_gather_object(ranks, mine)
                if rank == 0:
                    formula = bubble_fraction(2, m)
                    # per step: the busiest rank's busy time against the slower rank's wall time; median over steps
                    per_step = [
                        1 - max(r["busys"][i] for r in ranks) / max(r["walls"][i] for r in ranks) for i in range(args.steps)
                    ]
                    measured = statistics.median(per_step)
                    rows.append(
                        {
                            "schedule": schedule,
                            "stages": 2,
                            "microbatches": m,
                            "microbatch_size": args.microbatch_size,
                            "formula_bubble": formula,
                            "measured_bubble": measured,
                            "relative_error": (measured - formula) / formula,
                            "per_step_bubble": per_step,
                            "per_rank": ranks,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
        if rank == 0:
            print_table(rows, args)
    finally:
        dist.destroy_process_group()


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n2 stages x {args.blocks} MLP blocks (width {args.width}), micro-batch {args.microbatch_size}, "
          f"median of {args.steps} steps after {args.warmup} warm-up; gloo, 1 thread per rank")
    header = f"{'schedule':<10}{'m':>4}{'formula':>10}{'measured':>10}{'rel.err':>9}{'step_ms r0/r1':>18}{'busy_ms r0/r1':>18}"
    print(header)
    print("-" * len(header))
    for r in rows:
        step = "/".join(f"{x['step_s'] * 1e3:.1f}" for x in r["per_rank"])
        busy = "/".join(f"{x['busy_s'] * 1e3:.1f}" for x in r["per_rank"])
        print(f"{r['schedule']:<10}{r['microbatches']:>4}{r['formula_bubble']:>10.3f}{r['measured_bubble']:>10.3f}"
              f"{100 * r['relative_error']:>8.1f}%{step:>18}{busy:>18}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", default="4,8,16", help="comma-separated m values")
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: gpipe, 1f1b")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=1, help="MLP blocks per stage")
    p.add_argument("--microbatch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    args.schedules = [s.strip() for s in args.schedules.split(",")]
    return args


if __name__ == "__main__":
    arguments = parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(run_rank, args=(arguments, free), nprocs=2)
