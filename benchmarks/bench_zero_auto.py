"""What ``stage="auto"`` costs: the planner's trace and choice, ``lightning-zero plan``, and ``fit`` to the first step.

    python benchmarks/bench_zero_auto.py                       # all three parts, this tree only
    python benchmarks/bench_zero_auto.py --before <commit>     # also `plan` at <commit> (a git worktree), for before/after

Parts:

    choice  the trace and the choice (``planning.auto.choose``, in this process, imports done) for the main job's GPT
            (conf/gpt_zero3.yaml: 0.8M parameters, 16 x 64 tokens a rank) and for a 1.3B GPT (``plan --params``'s
            shapes, 4 x 1024 tokens a rank, bf16-mixed), 2 ranks, at an ample, a tight and a tighter budget each
    plan    ``lightning-zero plan`` wall time (a new interpreter: imports included) on the same two, here and, with
            ``--before``, at another commit
    fit     seconds from ``Trainer.fit`` to the first training batch on 2 CPU ranks (the main job's model and data,
            stage 1 by hand against ``stage="auto"``), the median of ``--rounds`` runs each

One JSON line per measurement, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB, MIB = 2**30, 2**20
#: (name, what to plan, budgets per device) for the choice and plan parts.
MAIN_JOB_BUDGETS = {"ample": 64 * MIB, "tight": 22 * MIB, "tighter": 14 * MIB}
BILLION_BUDGETS = {"ample": 40 * GIB, "tight": 12 * GIB, "tighter": 8 * GIB}
PLAN_RUNS = (
    ("main job", ["--config", "conf/gpt_zero3.yaml", "--memory-per-device", "16GiB"]),
    (
        "1.3B GPT",
        [
            "--params",
            "1.3e9",
            "--devices",
            "2",
            "--batch-size",
            "8",
            "--seq-len",
            "1024",
            "--memory-per-device",
            "12GiB",
        ],
    ),
)


def emit(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


def choice_part() -> list[dict]:
    import dataclasses

    from lightning_zero.config.zero_config import ZeroConfig
    from lightning_zero.planning import Planner, sources
    from lightning_zero.planning.auto import Budget, choose

    arguments = {f.name: getattr(ZeroConfig(stage="auto"), f.name) for f in dataclasses.fields(ZeroConfig)}
    from lightning_zero.cli.command_line import CommandLine
    from lightning_zero.cli.compose import compose
    from lightning_zero.cli.schema import LightningSchema

    config = compose(CommandLine.parse(["fit", "--config", "conf/gpt_zero3.yaml"]), LightningSchema("fit"))
    main_job = sources.from_config(config)
    billion = sources.from_size(1.3e9, 2, 8, 1024, "bf16-mixed")
    rows = []
    for name, source, budgets in (("main job", main_job, MAIN_JOB_BUDGETS), ("1.3B GPT", billion, BILLION_BUDGETS)):
        for budget_name, memory in budgets.items():
            start = time.perf_counter()
            planner = Planner(
                source.build,
                source.batch,
                world_size=2,
                precision=source.precision,
                checkpointing=source.checkpointing,
                backend="gloo" if name == "main job" else "nccl",
            )
            picked = choose(planner, Budget(memory, 0.1, 64 * GIB, "bench"), arguments, set(), split=True)
            seconds = time.perf_counter() - start
            rows.append(
                emit(
                    {
                        "part": "choice",
                        "model": name,
                        "budget": budget_name,
                        "memory_bytes": memory,
                        "seconds": round(seconds, 2),
                        "traces": len(planner._traces),
                        "choice": picked.describe(),
                    }
                )
            )
    return rows


def plan_part(before: str | None) -> list[dict]:
    trees = [("after", REPO)]
    worktree = None
    if before:
        worktree = Path(tempfile.mkdtemp(prefix="lz-before-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), before], cwd=REPO, check=True)
        trees.insert(0, (f"before ({before})", worktree))
    rows = []
    try:
        for label, tree in trees:
            for name, args in PLAN_RUNS:
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, "-m", "lightning_zero", "plan", *args],
                    cwd=tree,
                    env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                    capture_output=True,
                    text=True,
                )
                seconds = time.perf_counter() - start
                pick = next(
                    (line for line in done.stdout.splitlines() if line.startswith("Fastest")), done.stderr[-300:]
                )
                rows.append(
                    emit({"part": "plan", "tree": label, "model": name, "seconds": round(seconds, 2), "pick": pick})
                )
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    return rows


FIT_SCRIPT = """
import json, sys, time
import lightning as L
from lightning_zero import ZeroStrategy
from lightning_zero.demo import CharDataModule, GPTLightningModule

stage = sys.argv[1]
started = {}

class FirstBatch(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        started.setdefault("at", time.perf_counter())

L.seed_everything(1337)
model = GPTLightningModule(vocab_size=34, block_size=64, n_layer=4, n_head=4, n_embd=128, build_in_configure_model=True)
data = CharDataModule(block_size=64, batch_size=16, num_tokens=200000)
strategy = ZeroStrategy(stage="auto") if stage == "auto" else ZeroStrategy(stage=int(stage))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_val_batches=0, callbacks=[FirstBatch()])
begin = time.perf_counter()
trainer.fit(model, data)
if trainer.is_global_zero:
    print("FIT_TO_FIRST_STEP", json.dumps(started["at"] - begin))
"""


def fit_part(rounds: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "fit_first_step.py"
        script.write_text(FIT_SCRIPT)
        seconds: dict[str, list[float]] = {"1": [], "auto": []}
        for index in range(rounds):
            for stage in ("1", "auto") if index % 2 == 0 else ("auto", "1"):
                done = subprocess.run(
                    [sys.executable, str(script), stage], cwd=tmp, capture_output=True, text=True, timeout=600
                )
                line = next((x for x in done.stdout.splitlines() if x.startswith("FIT_TO_FIRST_STEP")), None)
                if line is None:
                    raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
                seconds[stage].append(json.loads(line.split(" ", 1)[1]))
        for stage, values in seconds.items():
            rows.append(
                emit(
                    {
                        "part": "fit",
                        "strategy": "stage=1" if stage == "1" else 'stage="auto"',
                        "median_seconds": round(statistics.median(values), 2),
                        "rounds": [round(v, 2) for v in values],
                    }
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="choice,plan,fit")
    parser.add_argument("--before", help="a commit to time `lightning-zero plan` at too")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    parts = args.parts.split(",")
    rows = []
    if "choice" in parts:
        rows += choice_part()
    if "plan" in parts:
        rows += plan_part(args.before)
    if "fit" in parts:
        rows += fit_part(args.rounds)
    print()
    for row in rows:
        if row["part"] == "choice":
            print(
                f"choice  {row['model']:<9} {row['budget']:<8} {row['seconds']:>6.2f} s  {row['traces']} steps traced or on a line  {row['choice']}"
            )
        elif row["part"] == "plan":
            print(f"plan    {row['model']:<9} {row['tree']:<22} {row['seconds']:>6.2f} s")
        else:
            print(f"fit     {row['strategy']:<14} {row['median_seconds']:>6.2f} s to the first batch  {row['rounds']}")


if __name__ == "__main__":
    main()
