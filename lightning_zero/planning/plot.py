"""The planner's table as stacked bars: one bar per configuration (and checkpointing choice), stacked by kind
(parameters, gradients, optimizer state, activations, buffers) at the predicted device peak, the host memory a
node needs beside it (hatched), the budget as a line. The PNG carries the plotted numbers in its ``Description``
text chunk (JSON), as ``estimate_plot.py`` does."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_zero.planning.predict import KINDS

_COLORS = dict(zip(KINDS, ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")))


def plot_plan(rows: list[dict], path: str | Path, title: str = "", limit: float | None = None) -> dict:
    """Write the chart of ``rows`` (``plan.describe``) to ``path`` and return what it shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'lightning-zero[plot]' (or matplotlib)") from err

    mib = 2**20
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 5), dpi=100)
    labels, shown = [], []
    for x, row in enumerate(rows):
        bottom = 0.0
        for kind in KINDS:
            height = row[kind] / mib
            ax.bar(x - 0.18, height, 0.36, bottom=bottom, color=_COLORS[kind])
            bottom += height
        if row["host_bytes"]:
            ax.bar(x + 0.18, row["host_bytes"] / mib, 0.36, color="white", edgecolor="#555555", hatch="//")
        labels.append(row["configuration"] + ("\n+ AC" if row["checkpointing"] else ""))
        shown.append({"label": labels[-1].replace("\n", " "), "device_MiB": row["device_bytes"] / mib,
                      "host_MiB": row["host_bytes"] / mib, **{k: row[k] / mib for k in KINDS}})
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in KINDS]
    names = [f"device: {k}" for k in KINDS]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#555555", hatch="//"))
    names.append("host (per node): offloaded state")
    if limit is not None:
        ax.axhline(limit / mib, color="black", linestyle="--")
        handles.append(plt.Line2D([0], [0], color="black", linestyle="--"))
        names.append(f"device budget {limit / mib:.0f} MiB")
    ax.legend(handles, names, fontsize=7, loc="upper right")
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title(title or "predicted peak per device, by kind")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Description": json.dumps({"bars": shown})})
    plt.close(fig)
    return {"bars": shown}
