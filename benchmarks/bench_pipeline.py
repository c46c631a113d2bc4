"""Pipeline bubble: measured idle share of a pipelined step, per schedule, against ``(p - 1) / (m + p - 1)``
and against 1F1B on the same job.

    python benchmarks/bench_pipeline.py                       # every schedule, m = 4 and 8, ZeRO stage 1
    python benchmarks/bench_pipeline.py --zero-stage 3        # the stages FSDP2-sharded (pipeline x ZeRO-3)
    python benchmarks/bench_pipeline.py --microbatches 4,8,16 --schedules gpipe,1f1b --steps 3

Two CPU ranks (gloo, one thread each) run one pipeline over ``2 x --blocks`` identical MLP blocks, cut into
2 equal stages (gpipe, 1f1b) or 4 (interleaved_1f1b, interleaved_zb: looped, stages r and r + 2; zbv,
dualpipev: a V, stages r and 3 - r), the same work per rank either way. It goes through what
``ZeroStrategy(pipeline_stages=2)`` builds (``PipelineParallel``, and with ``--zero-stage 3`` each stage an
FSDP2 root, here over a data-parallel group of one rank: the hooks, gathers and reshards of pipeline x
ZeRO-3 without the sharding's memory saving). Each (schedule, m) runs in fresh processes. For each rank:

* ``step``: the wall time of a pipelined training step (forward, loss, backward of m micro-batches);
* ``busy``: the CPU time the rank's main thread spent in that step (``time.thread_time``). The stage
  computes on that thread (one intra-op thread per rank), while waiting for the other stage blocks it
  without using CPU (gloo's transfers run on gloo's own threads);
* measured bubble, per step ``1 - busy / step`` of the busiest rank (the critical path: a lighter stage
  also waits for the heavier one, which the formula, assuming equal stages, does not count), the step being
  the slower rank's wall time, then the median over the steps: the share of the step the pipeline's
  bottleneck was not computing (waiting for the other stage, the transfers, and, on a loaded machine,
  waiting for a core);
* ``peak_mb``: the rank's peak resident memory during the steps above what it held before the first one
  (``ru_maxrss``): the step's activations, gradients and schedule buffers.

With equal stages GPipe's and 1F1B's idle share is ``(p - 1) / (m + p - 1)``: 0.200, 0.111 and 0.059 for
m = 4, 8, 16 on 2 stages; interleaving v stages per rank divides it by about v; the zero-bubble schedules
fill it with weight-gradient work. Rank 0 prints one JSON line per (schedule, m) and then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

from lightning_zero.pipeline import bubble_fraction  # noqa: E402

MULTI = {"interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"}  # two stages per rank


class Blocks(nn.Module):
    """The benchmark's model, with the two hooks ``pipeline_stages > 1`` asks of a LightningModule."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                for _ in range(2 * blocks)
            )
        )

    def pipeline_layers(self) -> nn.Sequential:
        return self.layers

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)


def run_rank(rank: int, args: argparse.Namespace, port: int, schedule: str, m: int, out: str) -> None:
    from lightning_zero.config.zero_config import ZeroConfig
    from lightning_zero.engine.stage3.fsdp2 import FullyShardedEngine
    from lightning_zero.pipeline import PipelineParallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = Blocks(args.width, args.blocks)
        config = ZeroConfig(stage=args.zero_stage, pipeline_stages=2, microbatches=m, pipeline_schedule=schedule)
        pipeline = PipelineParallel(model, config, rank, 2, torch.device("cpu"))
        engine = (
            FullyShardedEngine(model, device=torch.device("cpu"), stages=pipeline.stages)
            if args.zero_stage == 3
            else None
        )
        runner = pipeline.runner
        batch = args.microbatch_size * m
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, args.width, generator=g)
        y = torch.randn(batch, args.width, generator=g)
        params = [r.param for r in engine.records()] if engine is not None else list(runner.parameters())
        walls, busys = [], []
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for i in range(args.warmup + args.steps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            runner.step(x, y)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            for p in params:
                p.grad = None
            if i >= args.warmup:
                walls.append(dt)
                busys.append(dc)
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024  # KiB on Linux
        mine = {
            "rank": rank,
            "walls": walls,
            "busys": busys,
            "step_s": statistics.median(walls),
            "busy_s": statistics.median(busys),
            "peak_mb": peak_mb,
        }
        ranks = [None, None]
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            # per step: the busiest rank's busy time against the slower rank's wall time; median over steps
            per_step = [
                1 - max(r["busys"][i] for r in ranks) / max(r["walls"][i] for r in ranks) for i in range(args.steps)
            ]
            Path(out).write_text(
                json.dumps(
                    {
                        "schedule": schedule,
                        "zero_stage": args.zero_stage,
                        "stages": pipeline.layout.num_stages,
                        "microbatches": m,
                        "microbatch_size": args.microbatch_size,
                        "formula_bubble": bubble_fraction(2, m) if schedule not in MULTI else None,
                        "measured_bubble": statistics.median(per_step),
                        "step_s": max(r["step_s"] for r in ranks),
                        "peak_mb": [r["peak_mb"] for r in ranks],
                        "per_step_bubble": per_step,
                        "per_rank": ranks,
                    }
                )
            )
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, schedule: str, m: int) -> dict:
    """One (schedule, m) in a fresh pair of processes, so each peak memory is that run's own."""
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "row.json")
        mp.spawn(run_rank, args=(args, port, schedule, m, out), nprocs=2)
        return json.loads(Path(out).read_text())


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n2 ranks x {2 * args.blocks} MLP blocks (width {args.width}), ZeRO stage {args.zero_stage}, micro-batch "
        f"{args.microbatch_size}, median of {args.steps} steps after {args.warmup} warm-up; gloo, 1 thread per rank"
    )
    header = (
        f"{'schedule':<18}{'stages':>7}{'m':>4}{'formula':>9}{'measured':>10}{'step_ms':>9}{'vs 1f1b':>9}"
        f"{'busy_ms r0/r1':>16}{'peak_mb r0/r1':>16}"
    )
    print(header)
    print("-" * len(header))
    one_f_one_b = {r["microbatches"]: r["step_s"] for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        formula = f"{r['formula_bubble']:.3f}" if r["formula_bubble"] is not None else "-"
        base = one_f_one_b.get(r["microbatches"])
        ratio = f"{r['step_s'] / base:.2f}" if base else "-"
        busy = "/".join(f"{x['busy_s'] * 1e3:.0f}" for x in r["per_rank"])
        peak = "/".join(f"{x:.0f}" for x in r["peak_mb"])
        print(
            f"{r['schedule']:<18}{r['stages']:>7}{r['microbatches']:>4}{formula:>9}{r['measured_bubble']:>10.3f}"
            f"{r['step_s'] * 1e3:>9.1f}{ratio:>9}{busy:>16}{peak:>16}"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", default="4,8", help="comma-separated m values")
    p.add_argument(
        "--schedules",
        default="gpipe,1f1b,interleaved_1f1b,interleaved_zb,zbv,dualpipev",
        help="comma-separated pipeline_schedule values",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        default=1,
        choices=(1, 2, 3),
        help="3: each stage an FSDP2 root (pipeline x ZeRO-3); 1 and 2 shard nothing on one replica",
    )
    p.add_argument("--width", type=int, default=1024)
    p.add_argument(
        "--blocks",
        type=int,
        default=2,
        help="MLP blocks per rank (two stages of one block each for the schedules with two stages per rank)",
    )
    p.add_argument("--microbatch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    args.schedules = [s.strip() for s in args.schedules.split(",")]
    return args


if __name__ == "__main__":
    arguments = parse_args()
    results = []
    for name in arguments.schedules:
        for microbatches in arguments.microbatches:
            results.append(run(arguments, name, microbatches))
            print(json.dumps(results[-1]), flush=True)
    print_table(results, arguments)
