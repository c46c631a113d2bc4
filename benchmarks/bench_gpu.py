"""GPU benchmark: the ZeRO stages on CUDA, offload with pinned memory, bf16-mixed, and the largest GPT that trains.

    python benchmarks/bench_gpu.py                        # throughput table, then the largest-model search
    python benchmarks/bench_gpu.py --part throughput      # tokens/s, MFU and peak memory of every system
    python benchmarks/bench_gpu.py --part largest         # the largest GPT (doubling width, then depth) per system
    python benchmarks/bench_gpu.py --quick                # a tiny model: a smoke test of the CUDA paths

On a machine without CUDA it exits with status 2 and says so; CI does not run it.

Ranks: one per CUDA device, NCCL. With one device the systems run at world size 1 (NCCL cannot put two ranks on
one device: it refuses with "Duplicate GPU detected"), where the stages shard nothing and differ in mechanism
only: the figures then say what each stage's machinery costs on a GPU, and offload is where the memory goes.

What is measured (per system, in its own subprocess so that an out-of-memory failure or a leaked allocation
cannot touch the next one):

* step time: ``torch.cuda.synchronize`` at the start and end of each batch, median over the measured steps;
* tokens/s over all ranks and model FLOPs utilisation, ``(6 P + 12 L d T) x tokens/s / peak`` (nanoGPT's and
  PaLM's count, attention included, recomputation not) against the device's dense bf16 peak (``--peak-tflops``);
* peak ``torch.cuda.max_memory_allocated`` over the measured steps, against the ZeRO formulas for model state
  on the device (``lightning_zero.planning.formulas``); the rest of the peak is activations and transient buffers;
* the model state the strategy placed on the device and on the host (``lightning_zero.planning.accounting``);
* with ``--host-profile-steps N`` the training thread's host time by package (``host_profile.py``), and with
  ``--sync-steps N`` every call that made the host wait for the device, by Python stack (``sync_points.py``).

The largest-model search doubles the GPT's width, then its depth, then its width... from ``--search-base``; it
starts at the largest size whose ZeRO formula fits 85% of the device and host memory, walks up while a trial
trains two steps and down while one fails, and reports the last size that trained and why the next did not.
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

_BENCH_DIR = Path(__file__).resolve().parent
for path in (str(_BENCH_DIR.parent), str(_BENCH_DIR)):
    if path not in sys.path:
        sys.path.insert(0, path)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from bench_core import FSDP2GPTModule, build_strategy, formula_split, model_state_bytes  # noqa: E402
from host_profile import HostProfile, print_profiles  # noqa: E402
from sync_points import SyncPoints, print_sync_points  # noqa: E402
from timeline import profiler_config  # noqa: E402
from timeline import summary as timeline_summary  # noqa: E402

from lightning_zero.demo import GPTConfig, GPTLightningModule, RandomTokenDataModule, count_parameters  # noqa: E402
from lightning_zero.engine.offload import worker as host_step_worker  # noqa: E402
from lightning_zero.planning.accounting import model_state_bytes as placed_state_bytes  # noqa: E402

NO_CUDA_MESSAGE = (
    "bench_gpu.py needs a CUDA device and torch.cuda.is_available() is False here "
    "(torch {torch}, {devices} CUDA device(s)). Run benchmarks/bench_core.py for the CPU benchmark."
)
THROUGHPUT_SYSTEMS = (
    "ddp",
    "fsdp2",
    "zero1",
    "zero2",
    "zero3",
    "zero1+offload",
    "zero2+offload",
    "zero3+offload",
    "zero3+offload_params",
    "zero2+offload_delay",
)
SEARCH_SYSTEMS = ("zero1", "zero2", "zero3", "zero1+offload", "zero2+offload", "zero3+offload", "zero3+offload_params")
#: Dense bf16 tensor-core peaks (TFLOP/s) by a substring of the device name; --peak-tflops overrides.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}
# ~124M parameters: GPT-2 small's shape with a 32k vocabulary, a real workload for one GPU.
THROUGHPUT_MODEL = dict(vocab_size=32768, block_size=1024, n_layer=12, n_head=12, n_embd=768)
QUICK_MODEL = dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64)


def model_flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward) plus attention's scores and mixing."""
    return 6.0 * count_parameters(config) + 12.0 * config.n_layer * config.n_embd * config.block_size


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in device_name), None)


def ladder(base: dict[str, int], rungs: int) -> list[dict[str, int]]:
    """GPT shapes from ``base``, doubling the width (and heads), then the depth, alternately."""
    shapes, shape = [], dict(base)
    for rung in range(rungs):
        shapes.append(dict(shape))
        if rung % 2 == 0:
            shape["n_embd"], shape["n_head"] = 2 * shape["n_embd"], 2 * shape["n_head"]
        else:
            shape["n_layer"] = 2 * shape["n_layer"]
    return shapes


# --------------------------------------------------------------------------- one run (child)


class GPUBenchCallback(L.Callback):
    """Times steps with device synchronisation and records peak device memory over the measured steps."""

    def __init__(
        self, warmup: int, steps: int, profile_to: str | None = None, host_profile_steps: int = 0, sync_steps: int = 0
    ) -> None:
        self.warmup, self.steps = warmup, steps
        self.profile_to = profile_to  # a file: the profiler's tables over the measured steps (times then skewed)
        self.profiler: Any = None
        #: Steps after the measured ones under cProfile (host_profile.py): where the training thread's time goes.
        self.host_profile_steps = host_profile_steps
        self.host = HostProfile()
        self.host_summary: dict[str, Any] | None = None
        #: Steps after those under sync debug mode (sync_points.py): where the host waits for the device.
        self.sync_steps = sync_steps
        self.syncs = SyncPoints()
        self.sync_summary: dict[str, Any] | None = None
        self.times: list[float] = []
        self.cpu_seconds = 0.0  # the training process's CPU time (every thread) over the measured steps
        self.state: dict[str, int] = {}
        self.peak_allocated = 0
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if batch_idx == self.warmup:
                torch.cuda.reset_peak_memory_stats(device)
        if batch_idx == self.warmup and self.profile_to:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, experimental_config=profiler_config())
            self.profiler.__enter__()
        if self._host_profiled(batch_idx):
            self.host.enter()
        if self._sync_probed(batch_idx) and device.type == "cuda":
            if self.syncs.sees is None:
                self.syncs.check()
            self.syncs.enter()
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def _host_profiled(self, batch_idx: int) -> bool:
        start = self.warmup + self.steps
        return start <= batch_idx < start + self.host_profile_steps

    def _sync_probed(self, batch_idx: int) -> bool:
        start = self.warmup + self.steps + self.host_profile_steps
        return start <= batch_idx < start + self.sync_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        device = trainer.strategy.root_device
        if self._sync_probed(batch_idx) and device.type == "cuda":
            self.syncs.leave()
            if batch_idx == self.warmup + self.steps + self.host_profile_steps + self.sync_steps - 1:
                self.sync_summary = self.syncs.summary(self.sync_steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if self.warmup <= batch_idx < self.warmup + self.steps:
            self.times.append(time.perf_counter() - self._t0)
            self.cpu_seconds += time.process_time() - self._cpu0
        if self._host_profiled(batch_idx):
            self.host.leave()
            if batch_idx == self.warmup + self.steps + self.host_profile_steps - 1:
                self.host_summary = self.host.summary(self.host_profile_steps)
        if batch_idx == self.warmup + self.steps - 1 and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            events = self.profiler.key_averages()
            tables = [
                events.table(sort_by=key, row_limit=25) for key in ("self_cpu_time_total", "self_device_time_total")
            ]
            Path(self.profile_to).write_text("\n\n".join([timeline_summary(self.profiler, self.steps), *tables]))
        if batch_idx == self.warmup + self.steps - 1:
            if device.type == "cuda":
                self.peak_allocated = torch.cuda.max_memory_allocated(device)
            self.state = model_state_bytes(pl_module, trainer.optimizers)
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                placed = placed_state_bytes(
                    pl_module, [getattr(o, "_optimizer", o) for o in trainer.optimizers], engine
                )
                self.state["device"], self.state["host"] = placed["device"], placed["host"]


def pinned_fraction(engine: Any) -> float | None:
    """Share of the engine's host-resident state (masters, their gradient buffers) in page-locked memory: offload's
    device<->host copies are asynchronous only from pinned memory. None when nothing is on the host. (Adam's moments
    never travel, so they are ordinary host memory.)"""
    pinned = host = 0
    for _, tensor, on_host in engine.state_tensors() if engine is not None else ():
        tensor = getattr(tensor, "_local_tensor", tensor)
        if on_host and tensor.numel() > 0:
            host += tensor.nbytes
            pinned += tensor.nbytes if tensor.is_pinned() else 0
    return pinned / host if host else None


def run_one(args: argparse.Namespace) -> None:
    """Train one system for warmup + steps batches; rank 0 writes one JSON line to ``--out``."""
    torch.backends.cuda.matmul.allow_tf32 = True  # what anyone training fp32 on a GPU turns on
    if args.cores_left_to_training is not None:  # the host step's thread rule, varied ([Note: host-step threads])
        host_step_worker.CORES_LEFT_TO_TRAINING = args.cores_left_to_training
    L.seed_everything(0, verbose=False)
    shape = json.loads(args.shape)
    config = GPTConfig(**shape, dropout=0.0, bias=True)
    devices = args.devices
    total = args.warmup + args.steps + args.host_profile_steps + args.sync_steps
    data = RandomTokenDataModule(
        vocab_size=config.vocab_size,
        block_size=config.block_size,
        batch_size=args.batch_size,
        num_samples=2 * total * args.batch_size * devices,
    )
    bench = GPUBenchCallback(args.warmup, args.steps, args.profile_to, args.host_profile_steps, args.sync_steps)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=build_strategy(args.system, devices),
        precision=args.precision,
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        gradient_clip_val=args.gradient_clip_val,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[bench],
    )
    # FSDP2 (Lightning ModelParallelStrategy): each Block a unit, then the root, bf16 gathers under bf16-mixed.
    module_cls = FSDP2GPTModule if args.system == "fsdp2" else GPTLightningModule
    module = module_cls(**shape, dropout=0.0, bias=True, build_in_configure_model=True)
    if args.system == "fsdp2" and args.precision == "bf16-mixed":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        module.mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    trainer.fit(module, datamodule=data)
    if not trainer.is_global_zero:
        return
    device = trainer.strategy.root_device
    step_s = statistics.median(bench.times)
    P = count_parameters(config)
    tokens_per_s = args.batch_size * config.block_size * devices / step_s
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(name, args.peak_tflops)
    formula_device, formula_host = formula_split(args.system, P, devices, args.precision)
    result = {
        "system": args.system,
        "precision": args.precision,
        "devices": devices,
        "device_name": name,
        "params": P,
        "shape": shape,
        "batch_per_rank": args.batch_size,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": tokens_per_s,
        "cpu_ms_per_step": 1e3 * bench.cpu_seconds / max(1, len(bench.times)),
        "mfu": (model_flops_per_token(config) * tokens_per_s / (peak * 1e12 * devices)) if peak else None,
        "peak_allocated": bench.peak_allocated,
        "state": bench.state,
        "formula_device": formula_device,
        "formula_host": formula_host,
        "host_pinned_fraction": pinned_fraction(getattr(trainer.strategy, "engine", None)),
        "torch": torch.__version__,
        "host_profile": bench.host_summary,
        "syncs": bench.sync_summary,
    }
    Path(args.out).write_text(json.dumps(result) + "\n")


# --------------------------------------------------------------------------- driver (parent)


#: The delayed update's first steady step is its third: step 1's host step (creating the optimizer state) runs during
#: step 2, whose backward fills the second gradient buffers, allocated there (pinned memory: slow to allocate).
DELAYED_WARMUP = 2


def launch(
    system: str,
    shape: dict[str, int],
    args: argparse.Namespace,
    workdir: Path,
    steps: int,
    warmup: int,
    batch_size: int,
    host_profile_steps: int = 0,
    sync_steps: int = 0,
) -> tuple[dict[str, Any] | None, str]:
    """One system in a fresh process: (its result or None, why not: 'ok', 'out of memory', 'timeout', 'error')."""
    if "offload_delay" in system and warmup < DELAYED_WARMUP:
        print(
            f"   {system}: {DELAYED_WARMUP} warm-up steps, not {warmup}: its first host steps create the optimizer "
            "state and its second gradient buffers during the steps after them",
            file=sys.stderr,
            flush=True,
        )
        warmup = DELAYED_WARMUP
    out = workdir / f"{system}-{shape['n_layer']}x{shape['n_embd']}.json"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        system,
        "--out",
        str(out),
        "--shape",
        json.dumps(shape),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--batch-size",
        str(batch_size),
        "--devices",
        str(args.devices),
        "--precision",
        args.precision,
        "--accelerator",
        args.accelerator,
        "--host-profile-steps",
        str(host_profile_steps),
        "--sync-steps",
        str(sync_steps),
    ] + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])
    if args.cores_left_to_training is not None:
        cmd += ["--cores-left-to-training", str(args.cores_left_to_training)]
    if args.gradient_clip_val is not None:
        cmd += ["--gradient-clip-val", str(args.gradient_clip_val)]
    if args.part == "profile":
        cmd += ["--profile-to", str(Path(args.profile_dir) / f"profile_{system.replace('+', '_')}.txt")]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {args.timeout}s"
    log = proc.stdout + proc.stderr
    elapsed = time.perf_counter() - t0
    if proc.returncode == 0 and out.exists():
        print(f"   {system} {shape}: ok in {elapsed:.0f}s", file=sys.stderr, flush=True)
        return json.loads(out.read_text()), "ok"
    oom = "OutOfMemoryError" in log or "out of memory" in log.lower() or proc.returncode in (-9, 137)
    tail = "\n".join(log.splitlines()[-20:])
    print(f"!! {system} {shape}: rc={proc.returncode} in {elapsed:.0f}s\n{tail}\n", file=sys.stderr, flush=True)
    return None, "out of memory" if oom else f"error (rc={proc.returncode})"


def throughput(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    shape = QUICK_MODEL if args.quick else json.loads(args.model) if args.model else THROUGHPUT_MODEL
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
    for round_index in range(args.rounds):  # interleaved: a slow spell of the host hits every system alike
        for system in args.systems:
            result, _ = launch(
                system,
                shape,
                args,
                workdir,
                args.steps,
                args.warmup,
                args.batch_size,
                *((args.host_profile_steps, args.sync_steps) if round_index == 0 else (0, 0)),
            )
            if result is not None:
                runs[system].append({**result, "round": round_index})
                print(json.dumps({k: v for k, v in result.items() if k not in ("host_profile", "syncs")}), flush=True)
        if round_index == 0:  # now, not after the last round: a run cut short by its time limit keeps them
            print_profiles(
                {s: r[0].get("host_profile") for s, r in runs.items() if r},
                f"The training thread under cProfile over {args.host_profile_steps} steps after the measured "
                "ones, self time in ms per step, by package",
            )
            print_sync_points(
                {s: r[0].get("syncs") for s, r in runs.items() if r},
                f"Where the host waited for the device, over {args.sync_steps} steps under torch's sync "
                "debug mode (synchronising calls from Python, by stack, innermost frame last)",
            )
    results = [combine_rounds(rounds, runs.get("ddp", [])) for rounds in runs.values() if rounds]
    rows = [
        [
            r["system"],
            f"{r['step_ms']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "-",
            f"{r['vs_ddp']:.2f}" if r["vs_ddp"] is not None else "-",
            f"{r['cpu_ms_per_step']:.1f}",
            f"{r['peak_allocated'] / 2**30:.2f}",
            f"{r['state'].get('device', r['state'].get('total', 0)) / 2**30:.2f} ({r['formula_device'] / 2**30:.2f})",
            f"{r['state'].get('host', 0) / 2**30:.2f} ({r['formula_host'] / 2**30:.2f})",
            f"{100 * r['host_pinned_fraction']:.0f}" if r["host_pinned_fraction"] is not None else "-",
            " ".join(f"{x:.1f}" for x in r["rounds_step_ms"]),
        ]
        for r in results
    ]
    cols = [
        "system",
        "step_ms",
        "tokens/s",
        "MFU%",
        "vs_ddp",
        "host_cpu_ms/step",
        "peak_alloc_GiB",
        "state_device_GiB (formula)",
        "state_host_GiB (formula)",
        "host_pinned%",
        "rounds' step_ms",
    ]
    print_rows(cols, rows)
    if results:
        r = results[0]
        print(
            f"\n{r['device_name']}, {r['precision']}, torch {r['torch']}, {r['devices']} rank(s), P = {r['params']:,}, "
            f"batch {r['batch_per_rank']} x {r['shape']['block_size']} tokens per rank, median of {args.steps} steps "
            f"after {args.warmup} warmup, {args.rounds} interleaved round(s)"
            f"{'' if args.gradient_clip_val is None else f', gradients clipped at {args.gradient_clip_val:g}'}"
            ": step and CPU time the median of the "
            "rounds', vs_ddp the median of each round's ratio; GiB = 2^30 bytes."
        )
    return results


def combine_rounds(rounds: list[dict[str, Any]], ddp: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's rounds as one result: the first round's, with the medians of the timings and of each round's
    ratio to DDP's step time in the same round (the host's speed drifts between rounds; a ratio within one does not)."""
    ddp_ms = {r["round"]: r["step_ms"] for r in ddp}
    ratios = [r["step_ms"] / ddp_ms[r["round"]] for r in rounds if r["round"] in ddp_ms]
    first = rounds[0]
    return {
        **first,
        "rounds_step_ms": [r["step_ms"] for r in rounds],
        **{key: statistics.median(r[key] for r in rounds) for key in ("step_ms", "tokens_per_s", "cpu_ms_per_step")},
        "mfu": statistics.median(r["mfu"] for r in rounds) if first["mfu"] is not None else None,
        "vs_ddp": statistics.median(ratios) if ratios else None,
    }


def fits_formula(system: str, shape: dict[str, int], args: argparse.Namespace) -> bool:
    P = count_parameters(GPTConfig(**shape))
    device, host = formula_split(system, P, args.devices, args.precision)
    return device <= 0.85 * args.device_bytes and host * args.devices <= 0.85 * args.host_bytes


def largest(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Per system: the largest rung of the doubling ladder that trains, starting where the formula says it fits."""
    shapes = ladder(json.loads(args.search_base), args.rungs)
    found = []
    for system in args.search_systems:
        start = max((i for i, s in enumerate(shapes) if fits_formula(system, s, args)), default=0)
        tried: dict[int, str] = {}
        i = start
        while 0 <= i < len(shapes) and i not in tried:
            if not fits_formula(system, shapes[i], args) and i > start:
                tried[i] = "not tried: its formula exceeds 85% of device or host memory"  # a host OOM hurts the machine
                break
            _, tried[i] = launch(system, shapes[i], args, workdir, steps=1, warmup=1, batch_size=args.search_batch_size)
            i = i + 1 if tried[i] == "ok" else i - 1
        best = max((j for j, why in tried.items() if why == "ok"), default=None)
        failed_above = tried.get(best + 1 if best is not None else start)
        found.append(
            {
                "system": system,
                "largest": shapes[best] if best is not None else None,
                "largest_params": count_parameters(GPTConfig(**shapes[best])) if best is not None else 0,
                "next": shapes[best + 1] if best is not None and best + 1 < len(shapes) else None,
                "next_failed_by": failed_above,
                "tried": {str(count_parameters(GPTConfig(**shapes[j]))): why for j, why in tried.items()},
            }
        )
        print(json.dumps(found[-1]), flush=True)
    rows = [
        [
            f["system"],
            f"{f['largest_params'] / 1e9:.2f}B" if f["largest"] else "none",
            f"{f['largest']['n_layer']} x {f['largest']['n_embd']}" if f["largest"] else "-",
            f"{count_parameters(GPTConfig(**f['next'])) / 1e9:.2f}B: {f['next_failed_by']}" if f["next"] else "-",
        ]
        for f in found
    ]
    print_rows(["system", "largest that trains", "layers x width", "next rung"], rows)
    print(
        f"\n{args.precision}, batch {args.search_batch_size} x {json.loads(args.search_base)['block_size']} tokens, "
        f"2 steps per trial; host {args.host_bytes / 2**30:.0f} GiB, device {args.device_bytes / 2**30:.0f} GiB."
    )
    return found


def print_rows(cols: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    print("\n" + line + "\n" + "-" * len(line))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ZeRO stages on CUDA: throughput, memory and the largest GPT that trains")
    p.add_argument(
        "--part",
        choices=("all", "throughput", "largest", "profile"),
        default="all",
        help="profile: the throughput runs under torch.profiler, its tables written to --profile-dir",
    )
    p.add_argument("--profile-dir", default=".", help="where --part profile writes profile_<system>.txt")
    p.add_argument("--systems", default=",".join(THROUGHPUT_SYSTEMS), help="throughput systems, comma-separated")
    p.add_argument("--search-systems", default=",".join(SEARCH_SYSTEMS), help="largest-model systems")
    p.add_argument("--precision", default="bf16-mixed", choices=("bf16-mixed", "32-true"))
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every system (throughput)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank (throughput)")
    p.add_argument("--model", default=None, help="the throughput GPT's shape as JSON (default: ~136M, GPT-2 small's)")
    p.add_argument("--search-batch-size", type=int, default=1, help="sequences per rank (largest-model search)")
    p.add_argument(
        "--search-base",
        default=json.dumps(dict(vocab_size=32768, block_size=1024, n_layer=12, n_head=8, n_embd=1024)),
        help="first rung of the doubling ladder, as JSON",
    )
    p.add_argument("--rungs", type=int, default=7, help="rungs of the ladder")
    p.add_argument("--devices", type=int, default=0, help="ranks (default: every CUDA device)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per device for MFU")
    p.add_argument(
        "--host-profile-steps",
        type=int,
        default=0,
        help="steps after the measured ones under cProfile: host time by package (host_profile.py; 0: none)",
    )
    p.add_argument(
        "--sync-steps",
        type=int,
        default=0,
        help="steps after those under sync debug mode: the host's waits for the device by stack (0: none)",
    )
    p.add_argument(
        "--gradient-clip-val",
        type=float,
        default=None,
        help="Trainer(gradient_clip_val=...) for every system (clipping keeps an offloaded step after backward)",
    )
    p.add_argument(
        "--cores-left-to-training",
        type=int,
        default=None,
        help="cores an offloaded host step leaves to the training threads (default: the package's rule)",
    )
    p.add_argument("--timeout", type=int, default=300, help="seconds per run before it is killed")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke test of the CUDA paths")
    p.add_argument("--accelerator", default="cuda", help=argparse.SUPPRESS)  # "cpu": develop the script without a GPU
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one system (child mode)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--profile-to", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.search_systems = [s for s in args.search_systems.split(",") if s]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE.format(torch=torch.__version__, devices=torch.cuda.device_count()), file=sys.stderr)
        return 2
    if args.one:
        args.system = args.one
        run_one(args)
        return 0
    if args.accelerator == "cuda":
        args.devices = args.devices or torch.cuda.device_count()
        free, total = torch.cuda.mem_get_info(0)
        args.device_bytes = total
        print(
            f"{torch.cuda.get_device_name(0)}: {total / 2**30:.1f} GiB, {torch.cuda.device_count()} device(s), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        )
        if torch.cuda.device_count() < 2:
            print("One CUDA device: world size 1 only (NCCL puts one rank on one device).")
    else:
        args.devices = args.devices or 1
        args.device_bytes = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    args.host_bytes = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
        args.search_base = json.dumps(QUICK_MODEL)
        args.rungs = min(args.rungs, 3)
    if args.part == "profile":
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        if args.part in ("all", "throughput", "profile"):
            throughput(args, Path(tmp))
        if args.part in ("all", "largest"):
            largest(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
