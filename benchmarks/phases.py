"""Where a training step's time goes, per rank: a phase breakdown read from ``torch.profiler`` events.

A step is cut into three windows by the benchmark's callback, each a ``record_function`` range on the training
thread: ``bench::forward`` (batch start to ``on_before_backward``), ``bench::backward`` (to ``on_after_backward``,
so the strategy's end-of-backward reduction is inside) and ``bench::step`` (to the batch end: finalizing,
clipping, the optimizer step and, for ZeRO stages 1-2, the parameter all-gather).

[Note: attributing the training thread's time]
Every microsecond of a window on the training thread goes to exactly one category:

* ``param_gather``: inside a region that brings parameters back (stages 1-2's post-step all-gather,
  ``lightning_zero::param_all_gather``; FSDP2's unshard, wait and copy-out, which our stage 3 runs too);
* ``comm``: inside any other communication region (gradient reduce-scatters and all-reduces, their waits,
  DDP's bucket copies, FSDP2's post-backward reduction): communication the computation does not hide;
* ``forward`` / ``backward`` / ``step``: inside any other profiled operator of that window: computation;
* ``idle``: inside the window but inside no operator: Python between operators, and waits no library labels
  (DDP's reducer waits for its last all-reduce in C++, unlabeled, so DDP's exposed communication shows here).

A region's category covers everything inside it (an all-gather's copies are communication cost). Communication that overlaps computation runs on the backend's threads
and costs the training thread nothing: it is reported beside the breakdown as ``comm_threads``, the time other
threads spent in profiled operators (gloo's own collectives run there; the point-to-point transfers of our rings
are not profiled, so this column compares DDP and FSDP2 only). On a machine with as many ranks as cores that
work still competes with computation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

WINDOWS = ("forward", "backward", "step")
CATEGORIES = ("forward", "backward", "step", "param_gather", "comm", "idle")

#: Regions that bring parameters back (whole subtree).
_PARAM_GATHER = (
    "lightning_zero::param_all_gather",
    "FSDP::all_gather",
    "FSDP::pre_forward",
    "FSDP::pre_backward",
    "FSDP::forward_prefetch",
    "FSDP::backward_prefetch",
    "FSDP::root_pre_forward",
    "FSDP::post_forward",
)
#: Any other communication region (whole subtree).
_COMM = ("lightning_zero::", "c10d::", "record_param_comms", "torch.distributed.ddp.reducer", "FSDP::")
#: The backends' transfers, recorded as spans from posting to completion (not work of the thread they are
#: recorded on): left out of the training thread's time; a backend thread's collectives are its work.
_IN_FLIGHT = ("gloo:send", "gloo:recv", "nccl:")


def _category(name: str) -> str | None:
    if name.startswith(_PARAM_GATHER):
        return "param_gather"
    if name.startswith(_COMM):
        return "comm"
    return None


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _window_totals(window: Any, inside: list[Any]) -> dict[str, float]:
    """One window's microseconds by category, from the events wholly inside it on its thread."""
    spans = {"param_gather": [], "comm": [], "all": []}
    for event in inside:
        span = (event.time_range.start, event.time_range.end)
        spans["all"].append(span)
        category = _category(event.name)
        if category == "param_gather":
            spans["param_gather"].append(span)
        elif category == "comm":
            spans["comm"].append(span)
    gather = _covered(spans["param_gather"])
    communicating = _covered(spans["param_gather"] + spans["comm"])
    busy = _covered(spans["all"])
    return {
        "param_gather": gather,
        "comm": communicating - gather,
        window.name.removeprefix("bench::"): busy - communicating,
        "idle": window.time_range.elapsed_us() - busy,
    }


def breakdown(events: Iterable[Any], steps: int) -> dict[str, float]:
    """Milliseconds per step in each of :data:`CATEGORIES`, plus ``total`` (their sum: the windows' length) and
    ``comm_threads`` (other threads' time in profiled operators), from a profiler's ``events()`` over ``steps`` steps.

    Events are placed by time, not by the profiler's parent links: a range that spans windows (Lightning runs
    forward and backward inside ``optimizer.step(closure)``, which torch labels ``Optimizer.step#...``) is no
    operator of either and is left out; what runs inside it is counted where it runs."""
    events = list(events)
    windows = [e for e in events if e.name in {f"bench::{w}" for w in WINDOWS}]
    if not windows or steps < 1:
        return {}
    thread = windows[0].thread
    own = sorted(
        (e for e in events if e.thread == thread and not e.name.startswith(("bench::", *_IN_FLIGHT))),
        key=lambda e: e.time_range.start,
    )
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for window in windows:
        lo, hi = window.time_range.start, window.time_range.end
        inside = [e for e in own if lo <= e.time_range.start and e.time_range.end <= hi]
        for category, us in _window_totals(window, inside).items():
            totals[category] += us
    by_thread: dict[int, list[tuple[float, float]]] = {}
    for event in events:
        if event.thread != thread and not event.name.startswith(_IN_FLIGHT):
            by_thread.setdefault(event.thread, []).append((event.time_range.start, event.time_range.end))
    result = {name: us / 1e3 / steps for name, us in totals.items()}
    result["total"] = sum(result.values())
    result["comm_threads"] = sum(_covered(spans) for spans in by_thread.values()) / 1e3 / steps
    return result


class PhaseWindows:
    """Opens and closes the three ``bench::`` ranges on the training thread, and the profiler around them."""

    def __init__(self) -> None:
        self.profiler: Any = None
        self._open: Any = None

    def start(self) -> None:
        import torch

        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()

    def enter(self, window: str) -> None:
        import torch

        self.leave()
        self._open = torch.profiler.record_function(f"bench::{window}")
        self._open.__enter__()

    def leave(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None

    def stop(self, steps: int) -> dict[str, float]:
        self.leave()
        self.profiler.__exit__(None, None, None)
        return breakdown(self.profiler.events(), steps)
