"""Draw the comparison figures of the docs from the tables in the measurement files (matplotlib).

    python benchmarks/results/plot.py      # writes docs/step_time_cpu.png, docs/memory_vs_formula.png,
                                           # docs/planner_accuracy.png

Each figure reads its numbers from a Markdown table, found by its header row, so a re-measured table redraws.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
CPU = RESULTS / "2026-11-26-cpu-step-time.md"


def table(path: Path, header: str) -> list[list[str]]:
    """The body rows of the first table in ``path`` whose header row starts with ``header``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "").replace("`", "") for cell in line.strip("|").split("|")])
    return rows


def number(cell: str) -> float:
    return float(re.search(r"-?\d+(?:\.\d+)?", cell.replace(",", ""))[0])


def short(system: str) -> str:
    return system.replace("ZeroStrategy(", "").replace(")", "").replace("Lightning ", "")


def step_time() -> None:
    rows = table(CPU, "| system | step ms | round ratios to ddp: median (each round) | model state MB (formula)")
    names, ms, ratios = [short(r[0]) for r in rows], [number(r[1]) for r in rows], [number(r[2]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = ["#888888" if n in ("ddp", "FSDP2") else "#1f77b4" for n in names]
    bars = ax.bar(names, ms, color=colors)
    for bar, ratio in zip(bars, ratios):
        ax.annotate(
            f"{ratio:.2f}x ddp",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("step ms (median of 3 rounds)")
    ax.set_title("Step time, 27.4M GPT, 2 CPU ranks (2026-11-26); label: median round ratio to ddp", fontsize=9)
    fig.tight_layout()
    fig.savefig(DOCS / "step_time_cpu.png", dpi=110)
    plt.close(fig)


def memory() -> None:
    rows = table(CPU, "| system | step ms | tokens/s | step time vs DDP")
    names = [short(r[0]) for r in rows]
    measured, formula = [number(r[5]) for r in rows], [number(r[6]) for r in rows]
    labels = [re.search(r"\((.*)\)", r[6])[1] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], measured, width=0.4, label="measured (GC walk after backward)")
    ax.bar([i + 0.2 for i in x], formula, width=0.4, label="ZeRO formula", color="#bbbbbb")
    for i, label in zip(x, labels):
        ax.annotate(label, (i + 0.2, formula[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("model state MB per rank")
    ax.set_title("Model state per rank against the formulas, 27.4M GPT, fp32 AdamW, N=2 (2026-11-26)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "memory_vs_formula.png", dpi=110)
    plt.close(fig)


def planner() -> None:
    rows = table(DOCS / "planner.md", "| case (model, stage, precision")
    measured, predicted = [number(r[1]) for r in rows], [number(r[2]) for r in rows]
    models = [r[0].split(",")[0] for r in rows]
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    top = max(measured + predicted) * 1.08
    ax.plot([0, top], [0, top], color="black", linewidth=0.8, label="predicted = measured")
    ax.fill_between([0, top], [0, top * 0.9], [0, top * 1.1], color="#dddddd", label="±10% (the test's bar)")
    for model, marker in (("gpt", "o"), ("resnet", "s"), ("adapted", "^")):
        pts = [(m, p) for m, p, name in zip(measured, predicted, models) if name == model]
        ax.scatter(*zip(*pts), marker=marker, s=22, label=f"{model} ({len(pts)} cases)", zorder=3)
    ax.set_xlim(0, top), ax.set_ylim(0, top)
    ax.set_xlabel("measured peak MB per rank"), ax.set_ylabel("predicted peak MB per rank")
    ax.set_title("lightning-zero plan: predicted against measured", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "planner_accuracy.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    step_time()
    memory()
    planner()
