"""Every feature once on an accelerator: what the CPU suite proves over gloo, run where the tensors live on the
device and host state in pinned memory, so that a defect only a device shows (a tensor left on the wrong device,
a path taken on CUDA alone) costs one short call to find. The first lease on an H200 found one so
(``torch_versions/dtensor.py``: offloaded optimizer state moved to the device after the first step).

    python benchmarks/cuda_features.py                        # one CUDA device, about a minute
    python benchmarks/cuda_features.py --accelerator cpu      # the same rows on the CPU (develop without a GPU)

Each run trains the demo GPT a few steps on one device from the same seed and data, then reads the full
parameters. Four kinds of row:

* each stage against Lightning's ``ddp`` (fp32, TF32 off): different optimizer kernels, so within 5e-4;
* features that change no arithmetic against the plain run of their stage (fp32, within 1e-5): activation
  checkpointing with dropout (the recomputation must replay the device's RNG), unit sizes, a ``wrap_policy``,
  ``overlap_comm=False``, ``reduce_every_microbatch``, tied weights, ``init_weights`` from a safetensors file;
* host state under the device's mesh (the optimizer, the parameters, half the optimizer offloaded) with clipping,
  whose norm reduces host gradients over the device's backend, against the same clipped run on the device (5e-4);
* inexact features (compressed collectives) must train: a finite loss within 5% of the plain run's (at world
  size 1 nothing is sent, so on one device these rows show only that the settings run there);
* a run saved halfway and resumed against the uninterrupted run, bit for bit (bf16-mixed): full and sharded
  checkpoints, synchronous and asynchronous saves, with the optimizer and the parameters offloaded;

and ``ZeroMonitor`` must report the device's peak memory and the norm of offloaded gradients. Exit status 1 when a row fails.
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

from lightning_zero import ZeroMonitor, ZeroStrategy  # noqa: E402
from lightning_zero.demo import Block, GPTLightningModule, RandomTokenDataModule  # noqa: E402

MODEL = dict(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=64)
Params = dict[str, torch.Tensor]


class SaveAt(L.Callback):
    """A checkpoint after optimizer step ``step``."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class LastLoss(L.Callback):
    def __init__(self) -> None:
        self.loss = math.nan

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.loss = float(outputs["loss"])


def fit(
    args: argparse.Namespace,
    strategy: Any,
    precision: str = "32-true",
    *,
    module: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    steps: int | None = None,
    ckpt_path: Path | None = None,
    seed: int = 0,
) -> tuple[Params, float, L.Trainer]:
    """The full parameters after ``steps`` optimizer steps (default ``args.steps``), the last loss, the trainer.
    ``seed`` builds the model; the data and the rest of the run always start from seed 0."""
    L.seed_everything(seed, verbose=False)
    model = GPTLightningModule(**MODEL, learning_rate=1e-3, **(module or {}))
    L.seed_everything(0, verbose=False)
    data = RandomTokenDataModule(
        vocab_size=MODEL["vocab_size"], block_size=MODEL["block_size"], batch_size=4, num_samples=64
    )
    last = LastLoss()
    run = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=steps or args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[last, *callbacks],
        **(trainer or {}),
    )
    run.fit(model, data, ckpt_path=ckpt_path)
    full = run.strategy.full_state_dict() if hasattr(run.strategy, "full_state_dict") else model.state_dict()
    return {k: v.detach().double().cpu() for k, v in full.items()}, last.loss, run


def max_diff(a: Params, b: Params) -> float:
    if set(a) != set(b):
        return math.inf
    return max((a[k] - b[k]).abs().max().item() for k in a)


class Report:
    """Rows printed as they finish, failures collected."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def row(self, kind: str, name: str, figure: str, ok: bool) -> None:
        print(f"| {kind} | {name} | {figure} | {'ok' if ok else 'FAILED'} |", flush=True)
        if not ok:
            self.failed.append(f"{kind} {name}: {figure}")

    def attempt(self, kind: str, name: str, check: Any) -> None:
        try:
            check()
        except Exception as error:  # a crash is this script's finding: report it and go on to the next row
            self.row(kind, name, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}", False)


def against_ddp(args: argparse.Namespace, report: Report) -> None:
    for tied in (False, True):
        module = dict(tie_weights=tied)
        reference, _, _ = fit(args, "ddp", module=module)
        for stage in (1, 2, 3):

            def check(stage: int = stage) -> None:
                got, _, _ = fit(args, ZeroStrategy(stage=stage), module=module)
                diff = max_diff(got, reference)
                report.row("vs ddp", f"stage {stage}" + (", tied weights" if tied else ""), f"{diff:.1e}", diff <= 5e-4)

            report.attempt("vs ddp", f"stage {stage}" + (", tied weights" if tied else ""), check)


def exact_features(args: argparse.Namespace, report: Report, tmp: Path) -> None:
    plain: dict[tuple, Params] = {}

    def baseline(stage: int, module: dict[str, Any], trainer: dict[str, Any]) -> Params:
        key = (stage, tuple(sorted(module.items())), tuple(sorted(trainer.items())))
        if key not in plain:
            plain[key] = fit(args, ZeroStrategy(stage=stage), module=module, trainer=trainer)[0]
        return plain[key]

    weights = tmp / "init.safetensors"
    rows: list[tuple[str, int, dict[str, Any], dict[str, Any], dict[str, Any], int]] = [
        *(
            (
                f"activation checkpointing, dropout 0.1, stage {s}",
                s,
                dict(activation_checkpointing=Block),
                dict(dropout=0.1),
                {},
                0,
            )
            for s in (1, 2, 3)
        ),
        ("unit_size_mb=0 (a unit per block), stage 3", 3, dict(unit_size_mb=0), {}, {}, 0),
        ("wrap_policy={Block}, stage 3", 3, dict(wrap_policy={Block}), {}, {}, 0),
        ("overlap_comm=False, stage 2", 2, dict(overlap_comm=False), {}, {}, 0),
        (
            "reduce_every_microbatch, accumulate 2, stage 2",
            2,
            dict(reduce_every_microbatch=True),
            {},
            dict(accumulate_grad_batches=2),
            0,
        ),
        (
            "init_weights from safetensors (a model built from another seed), stage 3",
            3,
            dict(init_weights=str(weights)),
            {},
            {},
            1,
        ),
    ]
    from safetensors.torch import save_file

    L.seed_everything(0, verbose=False)
    save_file({k: v.contiguous() for k, v in GPTLightningModule(**MODEL).state_dict().items()}, str(weights))
    for name, stage, settings, module, trainer, seed in rows:

        def check(
            stage: int = stage,
            settings: dict = settings,
            module: dict = module,
            trainer: dict = trainer,
            seed: int = seed,
            name: str = name,
        ) -> None:
            got, _, _ = fit(args, ZeroStrategy(stage=stage, **settings), module=module, trainer=trainer, seed=seed)
            diff = max_diff(got, baseline(stage, module, trainer))
            report.row("vs plain", name, f"{diff:.1e}", diff <= 1e-5)

        report.attempt("vs plain", name, check)


def offloaded(args: argparse.Namespace, report: Report) -> None:
    """Host state under the device's mesh, where norms and gathers must stage through the device: clipped runs
    against the same run on the device (the host steps with another AdamW kernel, so within 5e-4)."""
    rows = [
        ("offload_optimizer, clip 0.5, stage 2", 2, dict(offload_optimizer=True)),
        ("offload_optimizer, clip 0.5, stage 3", 3, dict(offload_optimizer=True)),
        ("offload_params, clip 0.5, stage 3", 3, dict(offload_optimizer=True, offload_params=True)),
        ("offload_optimizer=0.5 (partial), clip 0.5, stage 2", 2, dict(offload_optimizer=0.5)),
    ]
    clipped = dict(gradient_clip_val=0.5)
    plain: dict[int, Params] = {}
    for name, stage, settings in rows:

        def check(stage: int = stage, settings: dict = settings, name: str = name) -> None:
            if stage not in plain:
                plain[stage] = fit(args, ZeroStrategy(stage=stage), trainer=clipped)[0]
            got, _, _ = fit(args, ZeroStrategy(stage=stage, **settings), trainer=clipped)
            diff = max_diff(got, plain[stage])
            report.row("offloaded", name, f"{diff:.1e}", diff <= 5e-4)

        report.attempt("offloaded", name, check)


def inexact_features(args: argparse.Namespace, report: Report) -> None:
    rows = [
        *((f"gradient_compression=int8, stage {s}", s, dict(gradient_compression="int8")) for s in (1, 2, 3)),
        (
            "gradient_compression=int4 + error_feedback, stage 2",
            2,
            dict(gradient_compression="int4", error_feedback=True),
        ),
        ("param_compression=bf16, stage 3", 3, dict(param_compression="bf16")),
    ]
    losses: dict[int, float] = {}
    for name, stage, settings in rows:

        def check(stage: int = stage, settings: dict = settings, name: str = name) -> None:
            if stage not in losses:
                losses[stage] = fit(args, ZeroStrategy(stage=stage))[1]
            _, loss, _ = fit(args, ZeroStrategy(stage=stage, **settings))
            ok = math.isfinite(loss) and abs(loss - losses[stage]) <= 0.05 * abs(losses[stage])
            report.row("trains", name, f"loss {loss:.4f} (plain {losses[stage]:.4f})", ok)

        report.attempt("trains", name, check)


def resumed(args: argparse.Namespace, report: Report, tmp: Path) -> None:
    rows = [
        (1, dict(async_save=True), "sharded"),
        (2, {}, "full"),
        (2, dict(offload_optimizer=True, async_save=True), "sharded"),
        (3, dict(async_save=True), "sharded"),
        (3, {}, "full"),
        (3, dict(offload_optimizer=True, offload_params=True, async_save=True), "sharded"),
    ]
    steps = 2 * args.steps
    for k, (stage, settings, kind) in enumerate(rows):
        name = f"stage {stage}, {kind}" + "".join(f", {key}" for key in settings)

        def check(
            stage: int = stage, settings: dict = settings, kind: str = kind, name: str = name, k: int = k
        ) -> None:
            chosen = dict(settings, state_dict_type=kind)
            whole, _, _ = fit(args, ZeroStrategy(stage=stage, **chosen), "bf16-mixed", steps=steps)
            path = tmp / f"resume-{k}.ckpt"
            fit(
                args,
                ZeroStrategy(stage=stage, **chosen),
                "bf16-mixed",
                steps=steps,
                callbacks=(SaveAt(args.steps, path),),
            )
            again, _, _ = fit(args, ZeroStrategy(stage=stage, **chosen), "bf16-mixed", steps=steps, ckpt_path=path)
            diff = max_diff(again, whole)
            report.row("resumed", name, f"{diff:.1e}", diff == 0.0)

        report.attempt("resumed", name, check)


def monitored(args: argparse.Namespace, report: Report) -> None:
    name = "ZeroMonitor with the gradient's norm, stage 3, offload_params"

    def check() -> None:
        monitor = ZeroMonitor(log_every_n_steps=1, grad_norm_type=2)
        fit(
            args, ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True), "bf16-mixed", callbacks=(monitor,)
        )
        peak = monitor.last.get("monitor/peak_MiB_rank0", math.nan)
        norm = monitor.last.get("monitor/grad_2.0_norm", monitor.last.get("monitor/grad_2_norm", math.nan))
        report.row("monitor", name, f"peak {peak:.1f} MiB, gradient norm {norm:.3f}", peak > 0 and math.isfinite(norm))

    report.attempt("monitor", name, check)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--parts", default="ddp,exact,offloaded,inexact,resumed,monitor", help="comma-separated groups")
    args = p.parse_args(argv)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print("cuda_features.py needs a CUDA device (or --accelerator cpu).", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 rows compare fp32 arithmetic
    device = torch.cuda.get_device_name(0) if args.accelerator == "cuda" else "CPU"
    print(f"{device}, torch {torch.__version__}, Lightning {L.__version__}, {args.steps} steps\n")
    print("| kind | row | figure | result |\n|---|---|---|---|", flush=True)
    report, parts = Report(), set(args.parts.split(","))
    with tempfile.TemporaryDirectory(prefix="cuda_features_") as tmp:
        groups = {
            "ddp": lambda: against_ddp(args, report),
            "exact": lambda: exact_features(args, report, Path(tmp)),
            "offloaded": lambda: offloaded(args, report),
            "inexact": lambda: inexact_features(args, report),
            "resumed": lambda: resumed(args, report, Path(tmp)),
            "monitor": lambda: monitored(args, report),
        }
        for name, run in groups.items():
            if name in parts:
                run()
    print("\n".join(["", "FAILED:", *report.failed]) if report.failed else "\nall rows passed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
