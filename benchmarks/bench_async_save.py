"""How long a checkpoint save blocks training: synchronous vs ``ZeroStrategy(async_save=True)``.

    python benchmarks/bench_async_save.py                 # the bench_core GPT (27M parameters), ZeRO-2
    python benchmarks/bench_async_save.py --quick         # tiny model: a smoke test, not a benchmark

2 CPU ranks, AdamW, batch 8 per rank, random tokens (as ``bench_core.py``). After the warm-up steps every
``--every``-th step saves a sharded checkpoint (``trainer.save_checkpoint`` from ``on_train_batch_end``; the
two newest are kept, older ones removed through the strategy as ``save_top_k`` does). Per step, each rank
measures:

* ``step``: forward, backward and optimizer step (``on_train_batch_start`` to ``on_train_batch_end``);
* ``blocked``: the time ``trainer.save_checkpoint`` holds the training loop (the whole write when
  synchronous; waiting for the previous save, staging the shards and writing ``meta.pt`` when async);
* for async, the steps right after a save, which share the CPU with the background writer.

Each mode runs in a fresh subprocess (the script re-invokes itself with ``--mode``; Lightning's launcher
then starts the other rank); modes alternate over ``--rounds``. Medians over saves and rounds; ``blocked`` is
the slowest rank's. One JSON line per run, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

FULL_MODEL = dict(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512)
QUICK_MODEL = dict(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)
MODES = ("sync", "async")


def run_mode(args: argparse.Namespace) -> None:
    """One training run in ``args.mode`` (a child; Lightning starts the other rank)."""
    import lightning as L
    import torch

    from lightning_zero import ZeroStrategy
    from lightning_zero.demo import GPTLightningModule, RandomTokenDataModule
    from lightning_zero.engine.comm import collectives

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    L.seed_everything(0, verbose=False)
    model_kw = QUICK_MODEL if args.quick else FULL_MODEL
    total = args.warmup + args.steps
    directory = Path(args.dir)

    class SaveBench(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.saved: list[Path] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step_ms = (time.perf_counter() - self.start) * 1e3
            measured = batch_idx >= args.warmup
            saves = measured and (batch_idx - args.warmup + 1) % args.every == 0
            blocked_ms = None
            if saves:
                path = directory / f"step={trainer.global_step}.ckpt"
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                blocked_ms = (time.perf_counter() - start) * 1e3
                self.saved.append(path)
                if len(self.saved) > 2:
                    trainer.strategy.remove_checkpoint(self.saved.pop(0))
            if measured:
                self.rows.append({"step_ms": step_ms, "blocked_ms": blocked_ms})

        def on_train_end(self, trainer, pl_module):
            start = time.perf_counter()
            trainer.strategy.wait_for_checkpoint()
            self.drain_ms = (time.perf_counter() - start) * 1e3

    bench = SaveBench()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, async_save=args.mode == "async"),
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[bench],
    )
    data = RandomTokenDataModule(
        vocab_size=model_kw["vocab_size"],
        block_size=model_kw["block_size"],
        batch_size=args.batch_size,
        num_samples=2 * total * args.batch_size * 2,
    )
    trainer.fit(GPTLightningModule(**model_kw, dropout=0.0, bias=True), datamodule=data)
    ranks = collectives.all_gather_objects({"rows": bench.rows, "drain_ms": bench.drain_ms})
    if trainer.is_global_zero:
        size = sum(f.stat().st_size for f in bench.saved[-1].rglob("*") if f.is_file())
        Path(args.out).write_text(json.dumps(summarise(args.mode, ranks, size)))


def summarise(mode: str, ranks: list[dict], checkpoint_bytes: int) -> dict:
    rows = ranks[0]["rows"]
    save_at = [i for i, row in enumerate(rows) if row["blocked_ms"] is not None]
    after = {i + 1 for i in save_at} | {i + 2 for i in save_at}
    plain = [row["step_ms"] for i, row in enumerate(rows) if i not in after and i not in save_at]
    blocked = [max(r["rows"][i]["blocked_ms"] for r in ranks) for i in save_at]
    return {
        "mode": mode,
        "step_ms": statistics.median(plain),
        "save_blocked_ms": statistics.median(blocked),
        "save_blocked_ms_each": [round(b, 1) for b in blocked],
        "steps_after_save_ms": statistics.median([rows[i]["step_ms"] for i in sorted(after) if i < len(rows)] or [0.0]),
        "drain_ms": max(r["drain_ms"] for r in ranks),
        "checkpoint_mib": checkpoint_bytes / 2**20,
        "saves": len(save_at),
    }


def run_child(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{mode}.json"
    ckpts = workdir / f"ckpt-{mode}"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--mode",
        mode,
        "--out",
        str(out),
        "--dir",
        str(ckpts),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--every",
        str(args.every),
        "--batch-size",
        str(args.batch_size),
    ] + (["--quick"] if args.quick else [])
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0 or not out.exists():
        raise SystemExit(f"{mode} failed (rc={result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    subprocess.run(["rm", "-rf", str(ckpts)], check=True)
    return json.loads(out.read_text())


def print_table(results: list[dict]) -> None:
    print(
        f"\n{'mode':<6} {'step ms':>9} {'save blocks ms':>15} {'steps after save ms':>20} {'drain ms':>9} "
        f"{'checkpoint MiB':>15}"
    )
    for mode in MODES:
        runs = [r for r in results if r["mode"] == mode]
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        after = f"{med('steps_after_save_ms'):.0f}" if mode == "async" else "-"
        print(
            f"{mode:<6} {med('step_ms'):>9.0f} {med('save_blocked_ms'):>15.0f} {after:>20} {med('drain_ms'):>9.0f} "
            f"{runs[0]['checkpoint_mib']:>15.1f}"
        )
    sync, background = (statistics.median(r["save_blocked_ms"] for r in results if r["mode"] == m) for m in MODES)
    print(
        f"\nasync blocks {background:.0f} ms per save against {sync:.0f} ms synchronous ({sync / background:.1f}x less)"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="step time a checkpoint save blocks: sync vs async_save (ZeRO-2, CPU)")
    p.add_argument("--steps", type=int, default=12, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--every", type=int, default=4, help="save every this many measured steps")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--rounds", type=int, default=2, help="sync and async alternate this many times")
    p.add_argument("--quick", action="store_true", help="tiny model: a smoke test, not a benchmark")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: one run (child)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.mode:
        run_mode(args)
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-async-save-") as tmp:
        for round_ in range(args.rounds):
            for mode in MODES:
                result = {**run_child(mode, args, Path(tmp) / f"round{round_}"), "round": round_}
                print(json.dumps(result), flush=True)
                results.append(result)
    print_table(results)


if __name__ == "__main__":
    main()
