"""Host overhead: the systems of bench_core.py on a GPT whose arithmetic is negligible, so that what a step costs
is the framework's own Python and C++ bookkeeping per parameter, hook and collective.

    python benchmarks/bench_overhead.py                           # fp32 and bf16-mixed, 3 interleaved rounds
    python benchmarks/bench_overhead.py --precision 32-true --rounds 1 --systems ddp,zero3

On a GPU a step waits for the host whenever the host's work per step exceeds the kernels' (a 136M GPT on an
H100); on 2 CPU cores the arithmetic of bench_core's 27M GPT hides that work. Here the model has hundreds of
parameter tensors (32 blocks of width 32, sequence 8, batch 2 per rank): bench_core's systems and figures,
step time and CPU time (every thread of both ranks) per step as ratios to Lightning DDP and to FSDP2
(Lightning ``ModelParallelStrategy``) in the same run, median of interleaved rounds, then a cProfile of a few
steps per system on rank 0 (``host_profile.py``): milliseconds per step by package, and our costliest functions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import ALL_SYSTEMS, combine_rounds, run_child  # noqa: E402
from host_profile import print_profiles  # noqa: E402

#: 32 blocks x 12 tensors + embeddings and the final norm: 390 parameter tensors, 0.42M parameters.
OVERHEAD_MODEL = dict(vocab_size=256, block_size=8, n_layer=32, n_head=2, n_embd=32)
TARGETS = {"zero1": ("ddp", 1.20), "zero2": ("ddp", 1.20), "zero3": ("fsdp2", 0.50)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    p.add_argument("--precision", default="32-true,bf16-mixed", help="comma-separated: 32-true, bf16-mixed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--host-profile-steps", type=int, default=5, help="cProfiled steps after the measured ones")
    p.add_argument("--model", default=json.dumps(OVERHEAD_MODEL), help="GPT settings (JSON)")
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--json", help="also write every result here")
    return p.parse_args()


def child_args(args: argparse.Namespace, precision: str) -> argparse.Namespace:
    """The arguments bench_core's driver hands each system's run."""
    return argparse.Namespace(
        steps=args.steps,
        warmup=args.warmup,
        devices=2,
        nodes=1,
        batch_size=args.batch_size,
        precision=precision,
        optimizer="adamw",
        profile_steps=0,
        host_profile_steps=args.host_profile_steps,
        accumulate=1,
        quick=False,
        monitor=False,
        timeout=600,
        model=args.model,
    )


def ratio(result: dict[str, Any], anchor: dict[str, Any] | None, key: str) -> float | None:
    """The median over rounds of this system's figure over the anchor's in the same round."""
    if anchor is None or len(result[key]) != len(anchor[key]):
        return None
    return statistics.median(mine / theirs for mine, theirs in zip(result[key], anchor[key]))


def print_times(results: dict[str, dict[str, Any]], precision: str) -> None:
    ddp, fsdp2 = results.get("ddp"), results.get("fsdp2")
    print(f"\n## {precision}: step and CPU time per step (median of rounds; ratios: median of each round's)\n")
    print("| system | step ms | vs DDP | vs FSDP2 | CPU ms/step | CPU vs DDP | CPU vs FSDP2 | rounds' step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for system, r in results.items():
        cells = [
            ratio(r, ddp, "rounds_step_ms"),
            ratio(r, fsdp2, "rounds_step_ms"),
            ratio(r, ddp, "rounds_cpu_ms"),
            ratio(r, fsdp2, "rounds_cpu_ms"),
        ]
        f = ["-" if c is None else f"{c:.2f}" for c in cells]
        rounds = " ".join(f"{x:.1f}" for x in r["rounds_step_ms"])
        print(
            f"| {system} | {r['step_ms']:.1f} | {f[0]} | {f[1]} | {r['cpu_ms_per_step']:.1f} | {f[2]} | {f[3]} | {rounds} |"
        )
    for system, (anchor, limit) in TARGETS.items():
        if system in results and anchor in results:
            step = ratio(results[system], results[anchor], "rounds_step_ms")
            cpu = ratio(results[system], results[anchor], "rounds_cpu_ms")
            met = step is not None and cpu is not None and step <= limit and cpu <= limit
            print(
                f"target {system} <= {limit:.2f}x {anchor} (step and CPU): {step:.2f} / {cpu:.2f} "
                f"{'met' if met else 'NOT met'}"
            )


def print_overhead_profiles(results: dict[str, dict[str, Any]], precision: str) -> None:
    print_profiles(
        {s: r["per_rank"][0].get("host_profile") for s, r in results.items()},
        f"{precision}: rank 0's training thread under cProfile, self time in ms per step, by package",
    )


def main() -> None:
    args = parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    everything = {}
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        for precision in [p.strip() for p in args.precision.split(",") if p.strip()]:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
            for round_index in range(args.rounds):  # interleaved: a slow spell hits every system alike
                for system in systems:
                    result = run_child(system, child_args(args, precision), Path(tmp) / f"{precision}-{round_index}")
                    if result is not None:
                        runs[system].append(result)
            results = {s: combine_rounds(runs[s]) for s in systems if runs[s]}
            failed = [s for s in systems if not runs[s]]
            first = next(iter(results.values()), None)
            if first:
                c = first["config"]
                print(
                    f"\n{precision}: GPT {c['n_layer']} blocks x width {c['n_embd']}, sequence {c['block_size']}, "
                    f"batch {first['batch_per_rank']} per rank, {first['params']:,} parameters, 2 CPU ranks (gloo); "
                    f"{args.steps} measured steps after {args.warmup}, {args.rounds} round(s)"
                    + (f"; FAILED: {', '.join(failed)}" if failed else "")
                )
            print_times(results, precision)
            print_overhead_profiles(results, precision)
            everything[precision] = results
    if args.json:
        Path(args.json).write_text(json.dumps(everything))


if __name__ == "__main__":
    main()
