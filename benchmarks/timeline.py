"""What overlaps in a profiled window: each lane's busy time, and how much of it runs beside the compute stream.

A lane is one host thread or one device stream of a ``torch.profiler`` trace. Offload's schedule is a claim about
lanes: gradient copies ride a copy stream while the compute stream runs backward, the host optimizer steps in a
worker thread meanwhile, and updated rows travel back while the host steps the next part. Per-operator tables
(``key_averages``) cannot show that; the union of each lane's event intervals, and its intersection with the
compute stream's, can. The compute stream is taken to be the busiest device lane (on a CPU-only trace there is
none, and the overlap column compares with the busiest host thread instead).

Host threads must be profiled at all: ``torch.profiler`` records only the thread that entered it unless asked for
every thread (``profile_all_threads``, torch's experimental config), which :func:`profiler_config` requests.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch._C._autograd import DeviceType

#: Ranges our benchmark callbacks open around phases: they span every lane's work, not one lane's.
_WINDOW_LABELS = ("ProfilerStep", "bench::", "PyTorch Profiler")


def profiler_config() -> Any:
    """Kineto's experimental config with every host thread profiled, or None where this torch lacks the switch."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _total(intervals: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length of the intersection of two merged, sorted interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


Lane = tuple[str, int]  # ("thread", its id) or ("stream", its id)


def lanes(profiler: Any) -> dict[Lane, tuple[list[tuple[int, int]], dict[str, int]]]:
    """Per lane: its merged busy intervals and its costliest event names, from a finished profiler's Kineto events."""
    intervals: dict[Lane, list[tuple[int, int]]] = defaultdict(list)
    names: dict[Lane, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    recorded: list[tuple[Lane, str, int, int]] = []
    for event in profiler.profiler.kineto_results.events():
        name = event.name()
        if any(label in name for label in _WINDOW_LABELS):
            continue
        on_host = event.device_type() == DeviceType.CPU
        key = ("thread", event.start_thread_id()) if on_host else ("stream", event.device_resource_id())
        recorded.append((key, name, event.start_ns(), event.duration_ns()))
    # An event still open when the profiler stopped (a host step running in the background) has no end: Kineto gives
    # it a sentinel ~2^62 ns away. It counts up to the last end the profiler saw.
    horizon = max((start + length for _, _, start, length in recorded if length < _OPEN), default=0)
    for key, name, start, length in recorded:
        end = start + length if length < _OPEN else max(start, horizon)
        intervals[key].append((start, end))
        names[key][name] += end - start
    return {key: (_merged(spans), names[key]) for key, spans in intervals.items() if spans}


#: Longer than any profiled window: the duration of an event the profiler never saw end.
_OPEN = 10**15


def summary(profiler: Any, steps: int) -> str:
    """A table of every lane: busy ms per step, the part of it beside the compute stream, its costliest events."""
    found = lanes(profiler)
    if not found:
        return "timeline: the profiler recorded no events"
    streams = [key for key in found if key[0] == "stream"]
    reference = max(streams or found, key=lambda key: _total(found[key][0]))
    ref_spans = found[reference][0]
    rows = []
    for key, (spans, by_name) in sorted(found.items(), key=lambda item: -_total(item[1][0])):
        busy = _total(spans)
        beside = _overlap(spans, ref_spans) if key != reference else busy
        top = sorted(by_name.items(), key=lambda item: -item[1])[:3]
        label = f"{key[0]} {key[1]}" + (" (compute)" if key == reference and streams else "")
        rows.append(
            (
                label,
                busy / 1e6 / steps,
                beside / 1e6 / steps,
                100.0 * beside / busy if busy else 0.0,
                ", ".join(f"{name[:40]} {ns / 1e6 / steps:.1f}" for name, ns in top),
            )
        )
    width = max(len(row[0]) for row in rows)
    lines = [
        f"timeline over {steps} step(s): per lane, ms a step inside a profiled event, the ms of it beside the "
        f"{'compute stream' if streams else 'busiest host thread'}, and its costliest events (ms a step)"
    ]
    lines.append(f"{'lane'.ljust(width)}  busy_ms  beside_ms  beside%  costliest")
    lines += [
        f"{label.ljust(width)}  {busy:7.1f}  {beside:9.1f}  {pct:6.0f}%  {top}"
        for label, busy, beside, pct, top in rows
    ]
    return "\n".join(lines)
