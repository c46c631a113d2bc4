"""Stages 1-2's gradient reduction and parameter gather, packed vs in place, on one process group.

    python benchmarks/bench_collectives.py                 # bench_core's 27M-parameter GPT, 2 CPU ranks
    python benchmarks/bench_collectives.py --ranks 3 --reps 10

The engine's own code on bench_core's parameter shapes and buckets (25 MB): the reduction is
``GradientReducer`` fed by a backward that hands every parameter a gradient in the order a GPT's backward does,
then ``flush``; the gather is ``all_gather_params`` after a step. Each repetition runs both ways back to back
(``collectives.packed_only()`` for the packed one), so the machine's slow drifts hit both alike; the figures are
medians over the repetitions, per rank, in ms. See [Note: collectives in place] in ``engine/comm/p2p_transport.py``.
"""

from __future__ import annotations

import argparse
import contextlib
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

from lightning_zero.demo.gpt import GPT, GPTConfig  # noqa: E402
from lightning_zero.engine.comm import collectives  # noqa: E402
from lightning_zero.engine.stage12.grad_sync import GradientReducer  # noqa: E402
from lightning_zero.engine.stage12.layout import plan_layout  # noqa: E402
from lightning_zero.engine.stage12.param_gather import all_gather_params  # noqa: E402
from lightning_zero.engine.stage12.zero_param import ZeroParam  # noqa: E402

MODEL = dict(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512)  # bench_core's FULL_MODEL
BUCKET_NUMEL = 25 * 2**20 // 4  # ZeroStrategy's default bucket_size_mb=25, fp32


def _one_step(params, reducer: GradientReducer, layout, rank: int, grads) -> tuple[float, float]:
    """One backward's reduction and one step's gather: (reduce ms, gather ms)."""
    start = time.perf_counter()
    # d(sum(p * g))/dp = g, accumulated last layer first, as a backward hands them out.
    loss = sum((p * g).sum() for p, g in zip(reversed(params), reversed(grads)))
    loss.backward()
    reducer.flush()
    reduced = time.perf_counter()
    reducer.consume(range(len(params)))
    all_gather_params(layout, params, range(len(layout.buckets)), rank=rank)
    return (reduced - start) * 1e3, (time.perf_counter() - reduced) * 1e3


def worker(rank: int, world: int, port: int, reps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in GPT(GPTConfig(**MODEL)).named_parameters()]
    params = [torch.nn.Parameter(torch.randn(shape)) for _, shape in shapes]
    grads = [torch.randn(shape) for _, shape in shapes]
    layout = plan_layout(shapes, world, BUCKET_NUMEL)
    figures = {way: {"reduce": [], "gather": []} for way in ("packed", "in_place")}
    for stage in (1, 2):
        records = [ZeroParam(i, p, layout.params[i], rank) for i, p in enumerate(params)]
        reducer = GradientReducer(records, layout, rank=rank, shard_gradients=stage == 2)
        for rep in range(reps + 1):  # the first repetition warms up
            for way in ("packed", "in_place") if rep % 2 else ("in_place", "packed"):
                with collectives.packed_only() if way == "packed" else contextlib.nullcontext():
                    dist.barrier()
                    reduce_ms, gather_ms = _one_step(params, reducer, layout, rank, grads)
                if rep:
                    figures[way]["reduce"].append((stage, reduce_ms))
                    figures[way]["gather"].append((stage, gather_ms))
        reducer.remove_hooks()
        for p in params:
            p.grad = None
    every = [None] * world
    dist.all_gather_object(every, figures)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=8, help="repetitions of each way per stage, after one warm-up")
    args = parser.parse_args()
    import socket
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "figures.json"
    mp.spawn(worker, args=(args.ranks, port, args.reps, str(out)), nprocs=args.ranks)
    every = json.loads(out.read_text())
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(GPTConfig(**MODEL)).parameters())
    print(
        f"P = {params:,} fp32 parameters, {args.ranks} ranks (gloo, 1 thread each), 25 MB buckets, median of "
        f"{args.reps} repetitions per way; ms per step, each rank"
    )
    print(f"{'stage':>5}  {'phase':>8}  {'rank':>4}  {'packed':>8}  {'in place':>8}  {'ratio':>6}")
    rows = []
    for stage in (1, 2):
        for phase in ("reduce", "gather"):
            for rank, figures in enumerate(every):
                packed, in_place = (
                    statistics.median(ms for s, ms in figures[way][phase] if s == stage)
                    for way in ("packed", "in_place")
                )
                rows.append(
                    {"stage": stage, "phase": phase, "rank": rank, "packed_ms": packed, "in_place_ms": in_place}
                )
                print(f"{stage:>5}  {phase:>8}  {rank:>4}  {packed:>8.1f}  {in_place:>8.1f}  {in_place / packed:>6.2f}")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
