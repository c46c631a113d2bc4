"""Exactness of the offloaded step's schedules on an accelerator: what the CPU test suite proves with synchronous
copies, run where copies ride copy streams behind events and the host steps in a worker thread.

    python benchmarks/cuda_checks.py                       # one CUDA device, a few seconds per run
    python benchmarks/cuda_checks.py --accelerator cpu     # the same checks on the CPU (develop without a GPU)

Each run trains the demo GPT a few steps on one device from the same seed and data, then reads the full
parameters. A configuration with ``overlap_comm=True`` (gradients leave bucket by bucket during backward, the
host steps part by part, early parts during backward where nothing clips) must equal the same configuration with
``overlap_comm=False`` (the host steps after backward) bit for bit. Both are also compared with the run without
offload, whose optimizer steps with another kernel (torch's for-loop or foreach AdamW, the host its fused one):
they agree to rounding, amplified where Adam's second moment is tiny (rows of the embedding no token of the
batch used), so that bound only catches a lost or doubled update.
``offload_step_delay=1`` is inexact by design: it must train (finite loss) and stay near the exact run. At world
size 1 stage 3 runs no reduce-scatter, so its host step starts from ``optimizer.step()``; stages 1-2 start it
during backward.

Then ``validate`` and ``predict`` before ``fit``: Lightning evaluates under inference mode where the backend is not
gloo (here, NCCL) unless the strategy turns it off, and tensors a stage-3 unit makes at its first all-gather are kept
for training; each fit after evaluating must end bit for bit where the fit alone does.

Then ``EMAWeightAveraging`` under bf16-mixed (the average of the optimizer's fp32 rows, held in host memory when
offloaded, over a device mesh in checkpoints): a run saved after half its steps, as a full file and as a sharded
directory, and resumed must end bit for bit where the uninterrupted run does. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.demo import GPTLightningModule, RandomTokenDataModule  # noqa: E402
from lightning_zero.engine.offload.schedule import HostStepSchedule  # noqa: E402

MODEL = dict(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=64)

#: (name, stage, ZeroStrategy settings, Trainer settings): small buckets, so the host steps in several parts.
CASES: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [
    *((f"stage{s}", s, dict(offload_optimizer=True, bucket_size_mb=0.05, unit_size_mb=0), {}) for s in (1, 2, 3)),
    *(
        (
            f"stage{s}_accumulate2",
            s,
            dict(offload_optimizer=True, bucket_size_mb=0.05, unit_size_mb=0),
            dict(accumulate_grad_batches=2),
        )
        for s in (1, 2, 3)
    ),
    *(
        (
            f"stage{s}_clip",
            s,
            dict(offload_optimizer=True, bucket_size_mb=0.05, unit_size_mb=0),
            dict(gradient_clip_val=0.5),
        )
        for s in (1, 2, 3)
    ),
    ("stage2_partial", 2, dict(offload_optimizer=0.5, bucket_size_mb=0.05), {}),
    ("stage3_params", 3, dict(offload_optimizer=True, offload_params=True, unit_size_mb=0), {}),
]


#: Parts of host steps started during backward, counted as the steps take them (whether the early path ran).
STARTED_EARLY = [0]
_take = HostStepSchedule.take


def _counting_take(self: HostStepSchedule) -> list:
    parts = _take(self)
    STARTED_EARLY[0] += len(parts)
    return parts


HostStepSchedule.take = _counting_take  # type: ignore[method-assign]


class LastLoss(L.Callback):
    def __init__(self) -> None:
        self.loss = math.nan

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.loss = float(outputs["loss"])


def train(
    args: argparse.Namespace,
    precision: str,
    stage: int,
    settings: dict[str, Any],
    trainer_settings: dict[str, Any],
    callbacks: tuple[L.Callback, ...] = (),
    steps: int | None = None,
    ckpt_path: Path | None = None,
    evaluate_first: bool = False,
) -> tuple[dict[str, torch.Tensor], float]:
    """The full parameters after ``steps`` (default ``args.steps``) optimizer steps, and the last loss;
    ``ckpt_path``: resumed from a checkpoint; ``evaluate_first``: after ``validate`` and ``predict`` on the trainer."""
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(**MODEL, learning_rate=1e-3)
    data = RandomTokenDataModule(
        vocab_size=MODEL["vocab_size"], block_size=MODEL["block_size"], batch_size=4, num_samples=64
    )
    last = LastLoss()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=ZeroStrategy(stage=stage, **settings),
        precision=precision,
        max_steps=steps or args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[last, *callbacks],
        **trainer_settings,
    )
    if evaluate_first:
        data.setup("fit")
        trainer.validate(module, data.train_dataloader(), verbose=False)
        trainer.predict(module, data.train_dataloader())
    STARTED_EARLY[0] = 0
    trainer.fit(module, data, ckpt_path=ckpt_path)
    full = trainer.strategy.full_state_dict()  # type: ignore[attr-defined]
    return {k: v.detach().double().cpu() for k, v in full.items()}, last.loss


#: (name, stage, ZeroStrategy settings) for the fits after evaluating.
EVALUATED_FIRST: list[tuple[str, int, dict[str, Any]]] = [
    ("stage1", 1, {}),
    ("stage2", 2, {}),
    ("stage3", 3, {}),
    ("stage3_offload_params", 3, dict(offload_optimizer=True, offload_params=True)),
]


def check_evaluation_first(args: argparse.Namespace, failed: list[str]) -> None:
    """A fit after ``validate`` and ``predict`` against the fit alone (see the docstring)."""
    print("\n| bf16-mixed | fit after validate and predict, against the fit alone |\n|---|---|")
    for name, stage, settings in EVALUATED_FIRST:
        alone, _ = train(args, "bf16-mixed", stage, settings, {})
        try:
            after, _ = train(args, "bf16-mixed", stage, settings, {}, evaluate_first=True)
        except RuntimeError as error:
            print(f"| {name} | {type(error).__name__}: {error} |", flush=True)
            failed.append(f"fit after evaluating, {name}: {error}")
            continue
        diff = max_diff(after, alone)
        print(f"| {name} | {diff:.1e} |", flush=True)
        if diff != 0.0:
            failed.append(f"fit after evaluating, {name}: ends {diff:.3e} from the fit alone")


#: (name, stage, ZeroStrategy settings) for the weight averaging checks.
AVERAGING: list[tuple[str, int, dict[str, Any]]] = [
    ("stage2", 2, {}),
    ("stage2_offload", 2, dict(offload_optimizer=True)),
    ("stage3_offload_params", 3, dict(offload_optimizer=True, offload_params=True)),
]


class SaveAt(L.Callback):
    """A checkpoint after optimizer step ``step`` (after the averaging callback's update)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def check_averaging(args: argparse.Namespace, failed: list[str]) -> None:
    """EMA resumed from a full file and a sharded directory against the uninterrupted run (see the docstring)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    print("\n| EMA, bf16-mixed | resumed from a full file | from a sharded directory |\n|---|---|---|")
    steps = 2 * args.steps
    for name, stage, settings in AVERAGING:
        whole, _ = train(args, "bf16-mixed", stage, settings, {}, (EMAWeightAveraging(decay=0.9),), steps=steps)
        diffs = []
        with tempfile.TemporaryDirectory() as tmp:
            for kind in ("full", "sharded"):
                chosen = {**settings, "state_dict_type": kind}
                path = Path(tmp) / f"{kind}.ckpt"
                train(
                    args,
                    "bf16-mixed",
                    stage,
                    chosen,
                    {},
                    (EMAWeightAveraging(decay=0.9), SaveAt(args.steps, path)),
                    steps=steps,
                )
                resumed, _ = train(
                    args, "bf16-mixed", stage, chosen, {}, (EMAWeightAveraging(decay=0.9),), steps=steps, ckpt_path=path
                )
                diffs.append(max_diff(resumed, whole))
        print(f"| {name} | {diffs[0]:.1e} | {diffs[1]:.1e} |", flush=True)
        failed.extend(
            f"EMA {name}: resumed from a {kind} checkpoint ends {diff:.3e} from the uninterrupted run"
            for kind, diff in zip(("full", "sharded"), diffs)
            if diff != 0.0
        )


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--precision", default="32-true,bf16-mixed", help="comma-separated")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names, 'evaluate_first' for the fits after "
        "evaluating, 'averaging' for the EMA checks (default: all)",
    )
    args = p.parse_args(argv)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print("cuda_checks.py needs a CUDA device (or --accelerator cpu).", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if args.accelerator == "cuda" else "CPU"
    print(f"{device}, torch {torch.__version__}, Lightning {L.__version__}, {args.steps} steps")
    chosen = set(args.cases.split(",")) if args.cases else None
    failed: list[str] = []
    print(
        "| precision | case | parts started in backward | overlap vs after backward | vs no offload | "
        "delayed update vs exact | last loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for precision in args.precision.split(","):
        plain: dict[int, dict[str, torch.Tensor]] = {}
        for name, stage, settings, trainer_settings in CASES:
            if chosen is not None and name not in chosen:
                continue
            overlapped, loss = train(args, precision, stage, {**settings, "overlap_comm": True}, trainer_settings)
            early = STARTED_EARLY[0]
            after, _ = train(args, precision, stage, {**settings, "overlap_comm": False}, trainer_settings)
            plain_key = hash((stage, tuple(sorted(trainer_settings.items()))))
            if plain_key not in plain:
                plain[plain_key], _ = train(args, precision, stage, {"bucket_size_mb": 0.05}, trainer_settings)
            exact = max_diff(overlapped, after)
            vs_plain = max_diff(overlapped, plain[plain_key])
            delayed_text = "-"
            if stage < 3 and settings.get("offload_optimizer") is True and not trainer_settings:
                delayed, delayed_loss = train(args, precision, stage, {**settings, "offload_step_delay": 1}, {})
                delayed_text = f"{max_diff(delayed, after):.2e} (loss {delayed_loss:.4f})"
                if not math.isfinite(delayed_loss) or abs(delayed_loss - loss) > 0.05 * abs(loss):
                    failed.append(f"{precision} {name}: delayed update loss {delayed_loss} against {loss}")
            print(
                f"| {precision} | {name} | {early} | {exact:.1e} | {vs_plain:.1e} | {delayed_text} | {loss:.4f} |",
                flush=True,
            )
            if exact != 0.0:
                failed.append(f"{precision} {name}: overlap_comm=True differs from False by {exact:.3e}")
            bound = 5e-4 if precision == "32-true" else 2e-2
            if vs_plain > bound:
                failed.append(f"{precision} {name}: {vs_plain:.3e} from the run without offload (bound {bound:g})")
    if chosen is None or "evaluate_first" in chosen:
        check_evaluation_first(args, failed)
    if chosen is None or "averaging" in chosen:
        check_averaging(args, failed)
    print("\n".join(["", "FAILED:", *failed]) if failed else "\nall checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
