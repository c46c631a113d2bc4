"""What the collective watchdog costs: step time with ``watchdog=True`` (the default) vs ``watchdog=False``.

    python benchmarks/bench_watchdog.py                 # ZeRO-2 and ZeRO-3 on bench_core's ~27M GPT, 3 rounds
    python benchmarks/bench_watchdog.py --quick --rounds 1

With the watchdog on, every collective of ``collectives.py`` is recorded in the flight recorder (a counter, a
running hash, a ring entry), every step leaves a mark, and a thread per rank samples the main thread and
exchanges heartbeats through the store once a second. Off, only the process-group timeout remains. Each
system runs in its own processes (``bench_core.run_child``), the systems interleaved round by round (A B C D,
A B C D, ...) so that a slow spell of a shared machine hits all alike; the figure is the median over rounds
of each run's median step time (worst rank). Prints JSON lines, then a table; the bar is < 2% overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_core  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="2,3", help="ZeRO stages to compare, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="bench_core's tiny model (a smoke test, not a measurement)")
    args = p.parse_args()
    core = argparse.Namespace(
        steps=args.steps,
        warmup=args.warmup,
        devices=2,
        batch_size=8,
        quick=args.quick,
        monitor=False,
        precision="32-true",
        timeout=900,
    )
    systems = [f"zero{s}{suffix}" for s in args.stages.split(",") for suffix in ("", "+nowatchdog")]
    runs: dict[str, list[float]] = {s: [] for s in systems}
    costs = unit_costs()
    print(json.dumps({"unit_costs": costs}))
    with tempfile.TemporaryDirectory(prefix="bench_watchdog_") as tmp:
        for round_index in range(args.rounds):
            # A B B A: on/off in one round, off/on in the next, so a drift of the machine cancels out.
            order = systems if round_index % 2 == 0 else [s for pair in zip(systems[1::2], systems[::2]) for s in pair]
            for system in order:
                result = bench_core.run_child(system, core, Path(tmp) / f"round{round_index}")
                if result is not None:
                    runs[system].append(result["step_ms"])
    rows = []
    for stage in args.stages.split(","):
        on, off = runs[f"zero{stage}"], runs[f"zero{stage}+nowatchdog"]
        if not on or not off:
            print(f"zero{stage}: a run failed (see above)", file=sys.stderr)
            continue
        row = {
            "stage": int(stage),
            "watchdog_on_ms": statistics.median(on),
            "watchdog_off_ms": statistics.median(off),
            "rounds_on_ms": on,
            "rounds_off_ms": off,
        }
        row["overhead_pct"] = 100.0 * (row["watchdog_on_ms"] / row["watchdog_off_ms"] - 1.0)
        rows.append(row)
        print(json.dumps(row))
    print()
    print(f"{'system':8}  {'watchdog on (ms)':>16}  {'off (ms)':>9}  {'overhead':>8}  rounds on / off (ms)")
    for row in rows:
        on, off = (" ".join(f"{x:.0f}" for x in row[key]) for key in ("rounds_on_ms", "rounds_off_ms"))
        rounds = f"{on} / {off}"
        print(
            f"zero{row['stage']:<4}  {row['watchdog_on_ms']:16.1f}  {row['watchdog_off_ms']:9.1f}  "
            f"{row['overhead_pct']:+7.2f}%  {rounds}"
        )
    print(
        f"\nmedian step time (worst rank) over {args.rounds} interleaved round(s) of {args.steps} steps after "
        f"{args.warmup} warmup; 2 CPU ranks, gloo, {'tiny' if args.quick else '~27M-parameter'} GPT, fp32."
    )
    print(
        f"measured unit costs: {costs['collective_us']:.2f} us per collective and {costs['mark_us']:.2f} us per "
        f"step on the main thread; the watchdog thread {costs['tick_ms']:.2f} ms (CPU) per tick plus "
        f"{costs['exchange_ms']:.2f} ms (wall, store round trip) per heartbeat, once a second."
    )


def unit_costs(repeat: int = 100_000) -> dict[str, float]:
    """What the watchdog adds, measured in this process: the flight recorder per collective and per step (main
    thread), one watchdog tick (sampling, record, decision) and one heartbeat exchange over a local TCPStore."""
    import datetime
    import time

    import torch
    from torch.distributed import TCPStore

    from lightning_zero.engine.comm.flight import RECORDER
    from lightning_zero.faults.diagnosis import Context, Limits
    from lightning_zero.faults.watchdog import Watchdog

    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    watchdog = Watchdog(store, "bench", 0, 2, Limits.for_timeout(60), Context(2), None, 1)
    watchdog.start()
    try:
        start = time.perf_counter()
        for _ in range(repeat):
            number = RECORDER.issue("all_gather", 1 << 20, torch.float32)
            RECORDER.wait(number, "all_gather")
            RECORDER.done(number)
        middle = time.perf_counter()
        for i in range(repeat):
            RECORDER.mark("train", i)
        end = time.perf_counter()
        ticks = 200
        cpu = time.thread_time()
        for _ in range(ticks):
            watchdog._tick(time.monotonic())
        tick = (time.thread_time() - cpu) / ticks
        wall = time.perf_counter()
        for _ in range(ticks):
            watchdog.exchange._cycle()
        exchange = (time.perf_counter() - wall) / ticks
    finally:
        watchdog.stop()
    return {
        "collective_us": 1e6 * (middle - start) / repeat,
        "mark_us": 1e6 * (end - middle) / repeat,
        "tick_ms": 1e3 * tick,
        "exchange_ms": 1e3 * exchange,
    }


if __name__ == "__main__":
    main()
