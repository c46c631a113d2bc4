"""Compression benchmark: the README's demo GPT (conf/gpt_zero3.yaml: its model, data, seed and 150 steps) on 2 CPU
ranks at stages 2 and 3, with gradients and weights travelling uncompressed, in 16 bits, in int8 and in int8 with
error feedback (and, at stage 3, int8 weights too: ZeRO++ qwZ).

    python benchmarks/bench_compression.py                      # the table of the README
    python benchmarks/bench_compression.py --steps 30 --stages 2  # a quicker look

Per run: the final loss (mean of the last 10 steps, as the main job's ``loss A -> B``), gradient and weight bytes per
step as ``comm_stats()`` counts what this rank hands the collectives (reduce-scatter or all-to-all input, all-gather
output: a ring puts (N-1)/N of it on the wire), and the median step time. On this CPU machine gloo moves bytes
between processes of one host, so the time mostly shows what encoding costs; the bytes are what a network would
carry.
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
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import lightning as L  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.cli.compose import Composer  # noqa: E402
from lightning_zero.demo import CharDataModule, GPTLightningModule  # noqa: E402
from lightning_zero.engine.comm.collectives import comm_stats  # noqa: E402

MODES = {
    "none": {},
    "fp16": {"gradient_compression": "fp16", "param_compression": "fp16"},
    "int8": {"gradient_compression": "int8"},
    "int8+ef": {"gradient_compression": "int8", "error_feedback": True},
    "int4+ef": {"gradient_compression": "int4", "error_feedback": True},
    "int8+ef+qwz": {"gradient_compression": "int8", "error_feedback": True, "param_compression": "int8"},
}
GRADIENT_KINDS = ("reduce_scatter", "all_to_all")


def demo_config() -> dict[str, Any]:
    """conf/gpt_zero3.yaml composed and resolved: the model's and data's arguments, seed and steps."""
    conf = _REPO / "conf"
    composed = OmegaConf.to_container(OmegaConf.create(Composer([conf]).file(conf / "gpt_zero3.yaml")), resolve=True)
    return composed


class Probe(L.Callback):
    """Losses, step times and the bytes of every step after the first (rank 0 reports every rank's worst)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.times: list[float] = []
        self.bytes: dict[str, int] = {}
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            comm_stats().reset()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t0)
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        self.bytes = dict(comm_stats().snapshot()["bytes_by_kind"])


def run_one(args: argparse.Namespace) -> None:
    config = demo_config()
    L.seed_everything(config["seed_everything"], verbose=False)
    model_args, data_args = config["model"]["init_args"], config["data"]["init_args"]
    stage, mode = args.one.split(":")
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=int(stage), **MODES[mode]),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[probe],
    )
    trainer.fit(GPTLightningModule(**model_args), datamodule=CharDataModule(**data_args))
    if trainer.is_global_zero:
        steps = len(probe.times) - 1
        grad = sum(probe.bytes.get(k, 0) for k in GRADIENT_KINDS) / steps
        result = {
            "stage": int(stage),
            "mode": mode,
            "steps": len(probe.losses),
            "final_loss": statistics.mean(probe.losses[-10:]),
            "gradient_bytes_per_step": grad,
            "weight_bytes_per_step": probe.bytes.get("all_gather", 0) / steps,
            "bytes_per_step": sum(probe.bytes.values()) / steps,
            "step_ms": 1e3 * statistics.median(probe.times[1:]),
            "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
        }
        Path(args.out).write_text(json.dumps(result))


def launch(stage: int, mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any] | None:
    out = workdir / f"{stage}-{mode}.json"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        f"{stage}:{mode}",
        "--out",
        str(out),
        "--steps",
        str(args.steps),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        print(f"!! stage {stage} {mode} failed:\n{(proc.stdout + proc.stderr)[-3000:]}", file=sys.stderr)
        return None
    print(f"   stage {stage} {mode}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description="compressed vs uncompressed gradients and weights on the demo GPT")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=0, help="steps (default: conf/gpt_zero3.yaml's, 150)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.steps or demo_config()["trainer"]["max_steps"]
    if args.one:
        run_one(args)
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_compression_") as tmp:
        for stage in map(int, args.stages.split(",")):
            for mode in args.modes.split(","):
                if mode.endswith("qwz") and stage != 3:
                    continue
                result = launch(stage, mode, args, Path(tmp))
                if result is not None:
                    results.append(result)
                    print(json.dumps(result), flush=True)
    header = [
        "stage",
        "compression",
        "final loss",
        "vs none",
        "gradient KB/step",
        "fewer gradient bytes",
        "weight KB/step",
        "all KB/step",
        "step ms",
    ]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in results:
        base = next((b for b in results if b["stage"] == r["stage"] and b["mode"] == "none"), r)
        print(
            f"| {r['stage']} | {r['mode']} | {r['final_loss']:.4f} | {100 * (r['final_loss'] / base['final_loss'] - 1):+.2f}% | "
            f"{r['gradient_bytes_per_step'] / 1e3:.1f} | {base['gradient_bytes_per_step'] / r['gradient_bytes_per_step']:.2f}x | "
            f"{r['weight_bytes_per_step'] / 1e3:.1f} | {r['bytes_per_step'] / 1e3:.1f} | {r['step_ms']:.1f} |"
        )
    if results:
        print(
            f"\n{results[0]['params']:,} parameters, 2 ranks, {args.steps} steps; final loss: mean of the last 10 "
            "steps; KB = 1e3 bytes per rank per step (comm_stats: collective input/output)."
        )


if __name__ == "__main__":
    main()
