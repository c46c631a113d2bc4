"""The host (CPU) AdamW step of the offload path, against DeepSpeed's ``DeepSpeedCPUAdam`` on the same machine.

    python benchmarks/bench_host_step.py                          # 1e7, 3e7, 1e8 elements; 1, 2, all threads
    python benchmarks/bench_host_step.py --sizes 1e6 --threads 1,2 --steps 3 --warmup 1
    python benchmarks/bench_host_step.py --impls torch-fused,torch-forloop --tensors 1 --json host_step.json
    python benchmarks/bench_host_step.py --impls torch-fused --threads 15,16 --busy 1   # a core taken meanwhile
    python benchmarks/bench_host_step.py --impls torch-fused,torch-fused-bf16 --tile 65536,4194304

With ``offload_optimizer`` the optimizer steps fp32 masters in host memory, and ``torch.optim.AdamW`` runs there with
torch's fused CPU kernel when the user left the kernel to torch (``host_kernel`` in ``engine/offload/host_step.py``):
``torch-fused`` is that, ``AdamW(fused=True)`` (built here directly: importing the package would cost each process
Lightning's import). ``torch-foreach`` and ``torch-forloop`` are torch's other kernels, for reference; ``deepspeed`` is
``DeepSpeedCPUAdam(adamw_mode=True)``, the step of DeepSpeed's ZeRO-Offload. ``torch-fused-bf16`` is
``ZeroStrategy(optimizer_state_dtype="bf16")``'s step (``engine/state_dtype.py``): the same fused kernel on moments held
in bf16 and widened to fp32 a tile (``--tile`` elements) at a time, 20 bytes per element to and from memory where a
tile's fp32 copy stays in cache (param 4 + 4, gradient 4, two moments 2 + 2 each). ``selective`` is selective updates'
host step (``offload_update_interval=k``, ``engine/offload/selective.py``), run once every ``k`` steps: AdamW with a
step count per column, torch's elementwise ops over tiles of rows, 36 bytes per element (the 28 of the step and the
interval's mean, a pass over the gradient). It is OpenMP, so its thread count is
fixed when the process starts: each size, thread count and implementation runs in a fresh process with
``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set. All take lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, on
GPT-like tensors (``--tensors``) whose gradients are set once; figures are medians over the measured steps.

An fp32 AdamW step moves 28 bytes per element (reads param, grad, exp_avg, exp_avg_sq; writes three of them),
so it is bound by memory bandwidth. Each process also times ``dst.add_(src)`` over the same footprint (2 x size
elements each side) at its thread count: 12 bytes per element, read and written in place as AdamW does (a
``copy_`` would also read its destination's lines before writing them, which its bytes/s leaves out). The table
gives the floor, 28 B x size / that bandwidth, and each step's share of it. A first, in-process check compares
the fused kernel's parameters after a few steps with DeepSpeed's.

DeepSpeed is imported here only, never by the package or its tests: ``pip install --no-deps deepspeed`` after
torch (pip must not replace torch), then its missing pure-Python requirements. Its CPU Adam JIT-builds with g++
on first use (about a minute), cached in ~/.cache/torch_extensions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

IMPLS = ("torch-fused", "torch-fused-bf16", "selective", "torch-foreach", "torch-forloop", "deepspeed")
HYPER: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BYTES_PER_ELEMENT = 28  # fp32 AdamW: 4 tensors read (16 B), 3 written (12 B)
#: What each implementation must move per element; bf16 moments: param 4 + 4, gradient 4, moments 2 + 2 each.
BYTES_BY_IMPL = {"torch-fused-bf16": 20, "selective": 36}
INSTALL_HINT = "pip install --no-deps deepspeed, then its missing pure-Python requirements; see the docstring"


def gpt_shapes(total: int, tensors: int) -> list[tuple[int, ...]]:
    """About ``tensors`` shapes of a GPT (12 per block, embeddings, final norm) summing exactly to ``total``: the
    blocks hold about 3/4 of it, the token embedding the rest. 1 is one flat tensor; under 16, equal flat pieces."""
    if tensors < 16:
        return [(total // tensors + (i < total % tensors),) for i in range(tensors)]
    layers = (tensors - 4) // 12
    width = math.isqrt(int(0.75 * total / (12 * layers)))
    width = max(8, width // 64 * 64 if width >= 64 else width // 8 * 8)
    d, h = width, 4 * width
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (h, d), (h,), (d, h), (d,)]
    shapes = [(min(1024, max(1, total // (8 * d))), d)] + block * layers + [(d,), (d,)]
    rest = total - sum(math.prod(s) for s in shapes)
    assert rest >= d, f"{total} elements are too few for {tensors} tensors"
    return [(rest // d, d)] + shapes + ([(rest % d,)] if rest % d else [])


def make_optimizer(impl: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if impl == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # its host step needs no device (nor a CUDA toolkit)
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # the only import of DeepSpeed, here in the benchmark

        return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)
    if impl.startswith("torch-fused"):  # what host_kernel makes of an AdamW whose kernel the user left to torch
        return torch.optim.AdamW(params, fused=True, **HYPER)
    return torch.optim.AdamW(params, foreach=impl == "torch-foreach", fused=False, **HYPER)


def selective_host_step(params: list[torch.Tensor]) -> Any:
    """Selective updates' host step (``engine/offload/selective.py``): AdamW with a step count per column, each
    parameter's rows a tile at a time, over every column (the device's too); the interval's mean gradient is taken in
    place first (one more pass over the gradient, 8 bytes an element)."""
    from lightning_zero.engine.offload.selective import AdamHyper, step_columns

    lr, (beta1, beta2) = HYPER["lr"], HYPER["betas"]
    hyper = AdamHyper(lr, beta1, beta2, HYPER["eps"], HYPER["weight_decay"], decoupled=True)
    work = []
    for p in params:
        columns = p.shape[1] if p.dim() >= 2 else 1
        steps = torch.full((columns,), 10.0, dtype=torch.float64)  # some columns' counts: each its own
        steps[::3] += 4
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        work.append((p, grad, torch.zeros_like(p), torch.zeros_like(p), *hyper.coefficients(steps)))

    def step() -> None:
        with torch.no_grad():
            for p, grad, exp_avg, exp_avg_sq, step_size, correction in work:
                grad.div_(1.0)
                step_columns(hyper, p, grad, exp_avg, exp_avg_sq, step_size, correction)

    return step


def make_params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def timed_ms(fn: Any, steps: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def stream_bandwidth(size: int, steps: int) -> float:
    """Bytes read + written per second by ``dst.add_(src)`` over 2 x ``size`` fp32 elements each (AdamW's 16 B
    per element of footprint): 3 x 4 B per element, median of ``steps`` after one."""
    src, dst = torch.randn(2 * size), torch.zeros(2 * size)
    ms = statistics.median(timed_ms(lambda: dst.add_(src), max(steps, 3), 1))
    return 3 * src.nbytes / (ms / 1e3)


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """One (size, threads, implementation) in this process: memory bandwidth, then the timed steps."""
    torch.set_num_threads(cell["threads"])
    bandwidth = stream_bandwidth(cell["size"], cell["steps"])
    params = make_params(gpt_shapes(cell["size"], cell["tensors"]), seed=0)
    start = time.perf_counter()
    opt = make_optimizer(cell["impl"], params)
    step = opt.step
    if cell["impl"] == "torch-fused-bf16":  # the package's import (Lightning's) only in these processes, untimed
        from lightning_zero.engine.state_dtype import StateDtype

        states = StateDtype("bf16", tile_elements=cell["tile"])
        step = lambda: states.step(opt)  # noqa: E731
    if cell["impl"] == "selective":
        step = selective_host_step(params)
    setup_s = time.perf_counter() - start  # DeepSpeed: loading (or JIT-building) its op
    ms = statistics.median(timed_ms(step, cell["steps"], cell["warmup"]))
    moved = BYTES_BY_IMPL.get(cell["impl"], BYTES_PER_ELEMENT)
    return {
        **cell,
        "n_tensors": len(params),
        "ms": ms,
        "elem_per_s": cell["size"] / (ms / 1e3),
        "bytes_per_element": moved,
        "bytes_per_s": moved * cell["size"] / (ms / 1e3),
        "stream_bytes_per_s": bandwidth,
        "floor_ms": moved * cell["size"] / bandwidth * 1e3,
        "setup_s": setup_s,
    }


def spawn_cell(cell: dict[str, Any], busy: int = 0) -> dict[str, Any]:
    """One cell in a fresh process, beside ``busy`` processes that each keep a core spinning: the offloaded step's
    host AdamW runs while the training thread (and, on a GPU, a thread spinning in a CUDA synchronisation) holds a
    core, and a ``parallel_for`` split evenly over every core waits for its slowest part."""
    n = str(cell["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(cell)], env=env, capture_output=True, text=True
        )
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {**cell, "error": ((proc.stderr or proc.stdout).strip().splitlines() or [f"rc {proc.returncode}"])[-1]}
    return json.loads(lines[-1])


def sanity_check(steps: int = 5) -> dict[str, Any]:
    """The fused kernel and DeepSpeed from the same start, ``steps`` steps: the largest parameter difference,
    absolute and relative to ``max(|param|, 1)`` (the two round in different orders: a few ulps apart)."""
    shapes = gpt_shapes(100_000, 16)
    start = time.perf_counter()
    runs = {}
    for impl in ("torch-fused", "deepspeed"):
        params = make_params(shapes, seed=1)
        opt = make_optimizer(impl, params)
        for _ in range(steps):
            opt.step()
        runs[impl] = torch.cat([p.flatten() for p in params])
    diff = (runs["torch-fused"] - runs["deepspeed"]).abs()
    relative = (diff / runs["deepspeed"].abs().clamp_min(1)).max().item()
    return {
        "max_abs_diff": diff.max().item(),
        "max_rel_diff": relative,
        "steps": steps,
        "agree_1e-6": relative <= 1e-6,
        "seconds_incl_deepspeed_load": time.perf_counter() - start,
    }


def print_table(size: int, rows: list[dict[str, Any]], threads: list[int], all_threads: int) -> None:
    print(
        f"\n## {size:.3g} elements ({rows[0].get('n_tensors', '?')} tensors): ms/step (Melem/s, GB/s moved at its "
        "bytes per element, share of the 28 B fp32 floor)\n"
    )
    heads = [f"{n} thread{'s' * (n > 1)}{' (all)' * (n == all_threads)}" for n in threads]
    print("| implementation | " + " | ".join(heads) + " |\n|---|" + "---|" * len(threads))
    ms = {(r["impl"], r.get("tile"), r["threads"]): r for r in rows if "error" not in r}
    ok = [[r for (_, _, t), r in ms.items() if t == n] for n in threads]  # the floor: median over this size's processes
    floors = [
        (
            statistics.median(BYTES_PER_ELEMENT * size / r["stream_bytes_per_s"] * 1e3 for r in o),
            statistics.median(r["stream_bytes_per_s"] for r in o),
        )
        if o
        else (math.nan, math.nan)
        for o in ok
    ]
    for impl, tile in dict.fromkeys((r["impl"], r.get("tile")) for r in rows):
        cells = [ms.get((impl, tile, n)) for n in threads]
        ours = " (ours)" if impl.startswith("torch-fused") else ""
        name = f"{impl}, tile {tile:.3g}" if impl == "torch-fused-bf16" else impl
        print(
            f"| {name}{ours}, {BYTES_BY_IMPL.get(impl, BYTES_PER_ELEMENT)} B/elem | "
            + " | ".join(
                "failed"
                if c is None
                else f"{c['ms']:.2f} ({c['elem_per_s'] / 1e6:.0f}, {c['bytes_per_s'] / 1e9:.1f}, {f[0] / c['ms']:.0%})"
                for c, f in zip(cells, floors)
            )
            + " |"
        )
    if any(r["impl"] == "deepspeed" for r in rows):
        ratios = [
            ms[("deepspeed", None, n)]["ms"] / ms[("torch-fused", None, n)]["ms"]
            if ("deepspeed", None, n) in ms and ("torch-fused", None, n) in ms
            else None
            for n in threads
        ]
        print(
            "| ours / deepspeed (throughput) | " + " | ".join("-" if x is None else f"{x:.2f}" for x in ratios) + " |"
        )
    print(
        f"| floor: {BYTES_PER_ELEMENT} B/elem at add_ bandwidth | "
        + " | ".join(f"{f[0]:.2f} ({f[1] / 1e9:.1f} GB/s)" for f in floors)
        + " |"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['impl']}, {r['threads']} thread(s) failed: {r['error']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e7,3e7,1e8", help="total elements, comma-separated")
    p.add_argument("--tensors", type=int, default=128, help="about this many GPT-like tensors; 1: one flat tensor")
    p.add_argument("--threads", default="1,2,all", help="comma-separated thread counts; all: every core")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--busy", type=int, default=0, help="cores kept spinning by other processes meanwhile")
    p.add_argument("--tile", default="4194304", help="torch-fused-bf16: elements widened at once, comma-separated")
    p.add_argument("--json", help="also write every result here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(run_cell(json.loads(args.child))))
        return
    all_threads = len(os.sched_getaffinity(0))
    threads = list(dict.fromkeys(all_threads if t.strip() == "all" else int(t) for t in args.threads.split(",")))
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    assert set(impls) <= set(IMPLS), f"--impls: unknown {set(impls) - set(IMPLS)}"
    has_ds = importlib.util.find_spec("deepspeed") is not None
    ds_version = importlib.metadata.version("deepspeed") if has_ds else "not installed"
    print(
        f"cpus {os.cpu_count()} (affinity {all_threads}), torch {torch.__version__}, deepspeed {ds_version}; "
        f"{args.steps} measured steps after {args.warmup}, median"
        + (f"; {args.busy} core(s) kept busy by other processes meanwhile" if args.busy else "")
    )
    if "deepspeed" in impls and not has_ds:
        print(f"deepspeed is not installed: its rows are left out ({INSTALL_HINT})")
        impls.remove("deepspeed")
    sanity = None
    if "deepspeed" in impls:
        try:
            sanity = sanity_check()
        except Exception as e:  # e.g. its JIT build failed: the error says why
            print(f"deepspeed failed, its rows are left out: {type(e).__name__}: {e}")
            impls.remove("deepspeed")
    if sanity:
        print(
            f"exactness: after {sanity['steps']} steps torch-fused vs deepspeed max |diff| "
            f"{sanity['max_abs_diff']:.2e}, relative to max(|param|, 1) {sanity['max_rel_diff']:.2e}: "
            f"{'within' if sanity['agree_1e-6'] else 'NOT within'} 1e-6 "
            f"({sanity['seconds_incl_deepspeed_load']:.1f} s, DeepSpeed's op load or JIT build included)"
        )
    results = []
    for size in sizes:
        cells = [
            dict(size=size, tensors=args.tensors, threads=n, impl=impl, steps=args.steps, warmup=args.warmup)
            for impl in impls
            for n in threads
        ]
        tiles = [int(float(t)) for t in args.tile.split(",")]
        cells = [
            {**cell, "tile": tile} if cell["impl"] == "torch-fused-bf16" else cell
            for cell in cells
            for tile in (tiles if cell["impl"] == "torch-fused-bf16" else [None])
        ]
        rows = [spawn_cell(cell, args.busy) for cell in cells]
        results += rows
        print_table(size, rows, threads, all_threads)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "deepspeed": ds_version,
                    "sanity": sanity,
                    "results": results,
                }
            )
        )


if __name__ == "__main__":
    main()
