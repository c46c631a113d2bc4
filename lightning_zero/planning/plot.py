"""The planner's table as stacked bars: one bar per configuration (and checkpointing choice), stacked by kind
(parameters, gradients, optimizer state, activations, buffers) at the predicted device peak, the host memory a
node needs beside it (hatched), the budget as a line, the pick (``with_pick``'s row) outlined and labelled. The
legend stands right of the axes, where it covers no bar. The PNG carries the plotted numbers, and where the axes
and the legend are in pixels, in its ``Description`` text chunk (JSON), as ``formulas_plot.py`` does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_zero.planning.formulas import format_bytes, unit_for
from lightning_zero.planning.formulas_plot import boxes_px
from lightning_zero.planning.predict import KINDS

if TYPE_CHECKING:
    from matplotlib.artist import Artist

_COLORS = dict(zip(KINDS, ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")))


def plot_plan(rows: list[dict], path: str | Path, title: str = "", limit: float | None = None) -> dict:
    """Write the chart of ``rows`` (``plan.describe``) to ``path`` and return what it shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'lightning-zero[plot]' (or matplotlib)") from err

    unit, scale = unit_for(*(r["device_bytes"] for r in rows), *(r["host_bytes"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)) + 2.5, 5), dpi=100)
    labels, shown = [], []
    for x, row in enumerate(rows):
        bottom = 0.0
        for kind in KINDS:
            height = row[kind] / scale
            ax.bar(x - 0.18, height, 0.36, bottom=bottom, color=_COLORS[kind])
            bottom += height
        if row["host_bytes"]:
            ax.bar(x + 0.18, row["host_bytes"] / scale, 0.36, color="white", edgecolor="#555555", hatch="//")
        label = (
            row["configuration"]
            + ("\n+ AC" if row["checkpointing"] else "")
            + (" (host)" if row.get("offload_activations") else "")
        )
        label += f"\n{row['micro_batch']} x {row['accumulate']}"
        if row.get("pick"):
            ax.bar(x - 0.18, bottom, 0.36, fill=False, edgecolor="black", linewidth=2.5)
            ax.annotate(
                "pick",
                (x - 0.18, bottom),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                fontweight="bold",
            )
            label += "\n(pick)"
        labels.append(label)
        shown.append(
            {
                "label": labels[-1].replace("\n", " "),
                "device_MiB": row["device_bytes"] / 2**20,
                "host_MiB": row["host_bytes"] / 2**20,
                "pick": bool(row.get("pick")),
                **{k: row[k] / 2**20 for k in KINDS},
            }
        )
    handles: list[Artist] = [plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in KINDS]
    names = [f"device: {k}" for k in KINDS]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#555555", hatch="//"))
    names.append("host (per node): offloaded state")
    tallest = max(max(r["device_bytes"], r["host_bytes"]) for r in rows)
    if limit is not None and limit <= 2 * tallest:  # a budget far above every bar would flatten them: named only
        ax.axhline(limit / scale, color="black", linestyle="--")
        handles.append(plt.Line2D([0], [0], color="black", linestyle="--"))
        names.append(f"device budget {format_bytes(limit, (unit, scale))}")
    elif limit is not None:
        handles.append(plt.Line2D([0], [0], color="white"))
        names.append(f"device budget {format_bytes(limit)} (above the chart)")
    legend = ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45, ha="right")
    for tick, row in zip(ax.get_xticklabels(), rows):
        if row.get("pick"):
            tick.set_fontweight("bold")
    ax.set_ylabel(f"predicted peak ({unit})")
    ax.set_title(title or "predicted peak per device, by kind")
    fig.tight_layout()
    result = {"bars": shown, **boxes_px(fig, ax, legend)}
    fig.savefig(path, format="png", metadata={"Description": json.dumps(result)})
    plt.close(fig)
    return result
