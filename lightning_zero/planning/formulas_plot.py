"""The estimate table as a bar chart: one group of bars per ZeRO stage, one bar per offload choice.

Device memory is the solid bar; the host memory a node needs for offloaded state is the hatched bar
beside it; the pick (the fastest choice that fits, when a budget is given) is outlined and labelled. The legend
stands right of the axes, where it covers no bar. The PNG carries the plotted numbers, and where the axes and the
legend are in pixels, in its ``Description`` text chunk (JSON), so a reader (or a test) can check the chart
without reading pixels.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_zero.planning.formulas import GIB, Estimate, format_bytes, unit_for

if TYPE_CHECKING:
    from matplotlib.artist import Artist

_STAGE_NAMES = {0: "DDP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
_COLORS = {"-": "#4C72B0", "optimizer": "#DD8452", "params+optimizer": "#55A868"}


def boxes_px(fig, ax, legend) -> dict:
    """The axes and the legend as ``[x0, y0, x1, y1]`` in image pixels, y from the top (call after layout)."""
    fig.canvas.draw()
    height = fig.get_size_inches()[1] * fig.dpi

    def box(extent) -> list[int]:
        return [round(extent.x0), round(height - extent.y1), round(extent.x1), round(height - extent.y0)]

    return {"axes_px": box(ax.get_window_extent()), "legend_px": box(legend.get_window_extent())}


def plot_estimates(
    estimates: Sequence[Estimate],
    path: str | Path,
    title: str = "",
    limit: float | None = None,
    pick: str | None = None,
) -> dict:
    """Write the chart to ``path`` (PNG) and return what it shows: groups, bars (``pick``: the name of the chosen
    one) and the axes and legend boxes in pixels."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'lightning-zero[plot]' (or matplotlib)") from err

    stages = sorted({e.choice.stage for e in estimates})
    offloads = list(dict.fromkeys(e.choice.offload for e in estimates))
    groups = {stage: [e for e in estimates if e.choice.stage == stage] for stage in stages}
    # each choice takes one slot for its device bar and one for its host bar (if it offloads) in its stage's group
    slots = {stage: sum(1 + bool(e.host_bytes_per_node) for e in group) for stage, group in groups.items()}
    width = 0.8 / max(slots.values())
    unit, scale = unit_for(*(e.device_bytes for e in estimates), *(e.host_bytes_per_node for e in estimates))
    fig, ax = plt.subplots(figsize=(11.5, 5), dpi=100)
    bars, ticks, names = [], [], []
    for g, stage in enumerate(stages):
        x = g - width * slots[stage] / 2 + width / 2
        for item in groups[stage]:
            color = _COLORS.get(item.choice.offload, "#8172B3")
            picked = item.choice.name == pick
            ax.bar(
                x,
                item.device_bytes / scale,
                width,
                color=color,
                edgecolor="black" if picked else "white",
                linewidth=2.5 if picked else 0.8,
            )
            if picked:
                ax.annotate(
                    "pick",
                    (x, item.device_bytes / scale),
                    xytext=(0, 4),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                    fontweight="bold",
                    bbox={"facecolor": "white", "pad": 1, "lw": 0},
                )
            ticks.append(x)
            names.append(item.choice.name + (" (pick)" if picked else ""))
            if item.host_bytes_per_node:
                x += width
                ax.bar(x, item.host_bytes_per_node / scale, width, color="white", edgecolor=color, hatch="//")
            x += width
            bars.append(
                {
                    "stage": stage,
                    "choice": item.choice.name,
                    "device_GiB": item.device_bytes / GIB,
                    "host_GiB": item.host_bytes_per_node / GIB,
                    "pick": picked,
                }
            )
    handles: list[Artist] = [plt.Rectangle((0, 0), 1, 1, color=_COLORS.get(o, "#8172B3")) for o in offloads]
    labels = [f"per device, {'no offload' if o == '-' else 'offload ' + o}" for o in offloads]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"))
    labels.append("per host (node), offloaded state")
    if limit is not None:
        ax.axhline(limit / scale, color="#C44E52", linestyle="--")
        handles.append(plt.Line2D([0], [0], color="#C44E52", linestyle="--"))
        labels.append(f"device memory {format_bytes(limit, (unit, scale))}")
    legend = ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_xticks(ticks, names, fontsize=7, rotation=40, ha="right")
    for tick, name in zip(ax.get_xticklabels(), names):
        if name.endswith("(pick)"):
            tick.set_fontweight("bold")
    for g, stage in enumerate(stages):  # the stage of each group, above its bars
        ax.text(
            g,
            1.01,
            _STAGE_NAMES.get(stage, f"stage {stage}"),
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_ylabel(f"model states ({unit})")
    ax.set_title(title or "model-state memory per device and per host", pad=18)
    ax.set_xlim(-0.5, len(stages) - 0.5)
    fig.tight_layout()
    shown = {
        "groups": [_STAGE_NAMES.get(s, f"stage {s}") for s in stages],
        "bars": bars,
        # x0, y0, x1, y1 in image pixels (y from the top), where the bars stand on the axes' y1
        **boxes_px(fig, ax, legend),
    }
    fig.savefig(path, format="png", metadata={"Description": json.dumps(shown)})
    plt.close(fig)
    return shown
