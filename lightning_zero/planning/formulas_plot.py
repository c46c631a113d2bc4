"""The estimate table as a bar chart: one group of bars per ZeRO stage, one bar per offload choice.

Device memory is the solid bar; the host memory a node needs for offloaded state is the hatched bar
beside it. The PNG carries the plotted numbers in its ``Description`` text chunk (JSON), so a reader
(or a test) can check the chart without reading pixels.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from lightning_zero.planning.formulas import GIB, Estimate

_STAGE_NAMES = {0: "DDP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
_COLORS = {"-": "#4C72B0", "optimizer": "#DD8452", "params+optimizer": "#55A868"}


def plot_estimates(estimates: Sequence[Estimate], path: str | Path, title: str = "", limit: float | None = None) -> dict:
    """Write the chart to ``path`` (PNG) and return what it shows: groups, bars and the figure's axes box in pixels."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'lightning-zero[plot]' (or matplotlib)") from err

    stages = sorted({e.choice.stage for e in estimates})
    offloads = list(dict.fromkeys(e.choice.offload for e in estimates))
    width = 0.8 / (2 * len(offloads))
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    bars = []
    for g, stage in enumerate(stages):
        group = [e for e in estimates if e.choice.stage == stage]
        for item in group:
            x = g - 0.4 + width * (2 * offloads.index(item.choice.offload) + 0.5)
            color = _COLORS.get(item.choice.offload, "#8172B3")
            ax.bar(x, item.device_bytes / GIB, width, color=color)
            if item.host_bytes_per_node:
                ax.bar(x + width, item.host_bytes_per_node / GIB, width, color="white", edgecolor=color, hatch="//")
            bars.append({"stage": stage, "choice": item.choice.name, "device_GiB": item.device_bytes / GIB,
                         "host_GiB": item.host_bytes_per_node / GIB})
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS.get(o, "#8172B3")) for o in offloads]
    labels = [f"per device, {'no offload' if o == '-' else 'offload ' + o}" for o in offloads]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"))
    labels.append("per host (node), offloaded state")
    if limit is not None:
        ax.axhline(limit / GIB, color="#C44E52", linestyle="--")
        handles.append(plt.Line2D([0], [0], color="#C44E52", linestyle="--"))
        labels.append(f"device memory {limit / GIB:.0f} GiB")
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    ax.set_xticks(range(len(stages)), [_STAGE_NAMES.get(s, f"stage {s}") for s in stages])
    ax.set_ylabel("model states (GiB)")
    ax.set_title(title or "model-state memory per device and per host")
    ax.set_xlim(-0.5, len(stages) - 0.5)
    fig.tight_layout()
    box = ax.get_window_extent()
    height = fig.get_size_inches()[1] * fig.dpi
    shown = {
        "groups": [_STAGE_NAMES.get(s, f"stage {s}") for s in stages],
        "bars": bars,
        # x0, y0, x1, y1 in image pixels (y from the top), where the bars stand on y1
        "axes_px": [round(box.x0), round(height - box.y1), round(box.x1), round(height - box.y0)],
    }
    fig.savefig(path, format="png", metadata={"Description": json.dumps(shown)})
    plt.close(fig)
    return shown
