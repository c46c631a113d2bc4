"""Step time of a LitGPT training loop in Lightning Fabric: ZeRO stages 1-3 against Fabric's own strategies.

    python benchmarks/bench_fabric.py                         # every system, 2 CPU ranks
    python benchmarks/bench_fabric.py --systems ddp,zero2 --steps 6

Systems (the same loop, model, data and AdamW; each in fresh processes, 2 ranks started as torchrun starts them):

    ddp           Fabric ``"ddp"``
    fsdp          Fabric ``FSDPStrategy`` (FSDP1), each LitGPT ``Block`` a unit, full sharding (Fabric runs it on GPUs
                  only: on a CPU the table says so)
    modelparallel Fabric ``ModelParallelStrategy`` (FSDP2): ``fully_shard`` per ``Block``, then the root
    zero1/2/3     ``lightning_zero.fabric.ZeroStrategy(stage=...)`` (``"zero3"`` etc. in Fabric's registry)

The loop is LitGPT's ``pretrain`` step: ``init_module(empty_init=True)`` and ``initialize_weights``, 2 micro-batches
accumulated under ``fabric.no_backward_sync``, ``chunked_cross_entropy``, ``fabric.clip_gradients(max_norm=1.0)``.
Step time is the wall time of one optimizer step (its micro-batches' forwards and backwards, clipping, the step),
the median over the measured steps, each rank's then the slowest rank's. Peak RSS is per rank (``ru_maxrss``). Every
system runs ``--rounds`` times, the order reversed each round; the table shows the median round, its ratio to
``ddp``'s median round, and every round's step time. One JSON line per run, then the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = ("ddp", "fsdp", "modelparallel", "zero1", "zero2", "zero3")
REPO = Path(__file__).resolve().parents[1]


def litgpt_config():
    from litgpt import Config

    return Config(
        n_layer=6,
        n_head=8,
        n_embd=256,
        block_size=128,
        vocab_size=4096,
        padded_vocab_size=4096,
        bias=True,
        rotary_percentage=1.0,
    )


def build_strategy(system: str):
    """The strategy object (or registered name) a system runs with."""
    import torch
    from litgpt.model import Block

    if system == "ddp":
        return "ddp"
    if system == "fsdp":
        from lightning.fabric.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD", state_dict_type="sharded")
    if system == "modelparallel":
        from lightning.fabric.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import fully_shard

        def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
            mesh = device_mesh["data_parallel"]
            for layer in model.modules():
                if isinstance(layer, Block):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model

        return ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    return system  # "zero1", "zero2", "zero3": lightning_zero's names in Fabric's registry


def run_system(args: argparse.Namespace) -> None:
    """One rank of one system: the loop, timed."""
    import lightning as L
    import torch
    from litgpt import GPT
    from litgpt.pretrain import initialize_weights
    from litgpt.utils import chunked_cross_entropy

    import lightning_zero  # noqa: F401 - registers "zero1" / "zero2" / "zero3" with Fabric

    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=build_strategy(args.system))
    fabric.launch()
    config = litgpt_config()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1))
    tokens = torch.randint(0, config.vocab_size, (args.batch, config.block_size + 1))
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        for micro in range(args.accumulate):
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(tokens[:, :-1])
                loss = chunked_cross_entropy(logits, tokens[:, 1:])
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    mine = {
        "step_ms": 1000 * statistics.median(times),
        "all_ms": [round(1000 * t) for t in times],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": float(loss),
    }
    ranks = [None, None]
    torch.distributed.all_gather_object(ranks, mine)
    if fabric.global_rank == 0:
        params = sum(p.numel() for p in GPT(config).parameters())
        line = {
            "system": args.system,
            "params": params,
            "step_ms": max(r["step_ms"] for r in ranks),
            "step_ms_per_rank": [round(r["step_ms"], 1) for r in ranks],
            "steps_ms_rank0": mine["all_ms"],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "loss": mine["loss"],
            "batch": args.batch,
            "accumulate": args.accumulate,
            "steps": args.steps,
        }
        Path(args.out).write_text(json.dumps(line) + "\n")


def run_child(system: str, args: argparse.Namespace, out: Path) -> dict:
    """Two ranks of ``system`` in fresh processes, started with torchrun's environment; a system that fails reports
    its last error line (Fabric's FSDP1 refuses a CPU)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, __file__, "--system", system, "--out", str(out), *_shared(args)]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [proc.communicate(timeout=args.timeout)[0] for proc in procs]
    if any(proc.returncode for proc in procs) or not out.exists():
        print(f"{system} failed:\n{outputs[0][-3000:]}\n{outputs[1][-3000:]}", file=sys.stderr)
        lines = [line for line in outputs[0].splitlines() if "Error" in line]
        return {"system": system, "failed": lines[-1] if lines else "see stderr"}
    return json.loads(out.read_text())


def _shared(args: argparse.Namespace) -> list[str]:
    return [
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--batch={args.batch}",
        f"--accumulate={args.accumulate}",
    ]


def print_table(results: list[dict]) -> None:
    ran = [r for r in results if "failed" not in r]
    ddp = next((r for r in ran if r["system"] == "ddp"), None)
    print(f"\nLitGPT {ran[0]['params'] / 1e6:.1f}M params, 2 CPU ranks, Fabric loop")
    print(f"{'system':<14} {'step ms':>9} {'x ddp':>7} {'peak RSS MiB':>13} {'loss':>8}  rounds (ms)")
    for r in results:
        if "failed" in r:
            print(f"{r['system']:<14} did not run: {r['failed']}")
            continue
        ratio = f"{r['step_ms'] / ddp['step_ms']:.2f}" if ddp else "-"
        rounds = ", ".join(f"{ms:.0f}" for ms in r.get("rounds_step_ms", []))
        print(
            f"{r['system']:<14} {r['step_ms']:>9.1f} {ratio:>7} {r['peak_rss_mib']:>13.0f} {r['loss']:>8.4f}  {rounds}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before measuring")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch rows per rank")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every system, alternating their order")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.system:
        run_system(args)
        return
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_fabric_{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    rounds: dict[str, list[dict]] = {system: [] for system in systems}
    for index in range(args.rounds):  # the systems in turn, each round in the other order: a drifting machine
        for system in systems if index % 2 == 0 else systems[::-1]:  # slows no one system alone
            result = run_child(system, args, workdir / f"{system}.json")
            result["round"] = index
            print(json.dumps(result), flush=True)
            rounds[system].append(result)
    results = [_combined(runs) for runs in rounds.values()]
    if any("failed" not in r for r in results):
        print_table(results)


def _combined(runs: list[dict]) -> dict:
    """A system's rounds: the median round's figures, and every round's step time."""
    ran = [r for r in runs if "failed" not in r]
    if not ran:
        return runs[0]
    ran.sort(key=lambda r: r["step_ms"])
    return {**ran[len(ran) // 2], "rounds_step_ms": [round(r["step_ms"], 1) for r in runs if "failed" not in r]}


if __name__ == "__main__":
    main()
