"""Where a training step makes the host wait for the device, by the Python stack that asked.

On a GPU a step is as fast as its kernels only while the host stays ahead of the device: every call that waits
for the device (a tensor's ``item`` or ``tolist``, a copy into pageable host memory, ``nonzero``,
``synchronize``) drains the queue, and the device then idles while the host launches what comes next. Such a call
costs nothing on a CPU, so no CPU benchmark sees it. ``torch.cuda.set_sync_debug_mode("warn")`` makes torch warn
at each one; :class:`SyncPoints` turns that on over a few steps and counts the warnings by the stack of the
Python frames that made them, so a report names the line, whoever's it is. Calls made in C++ alone (the autograd
engine's device thread outside Python hooks) warn on stderr without a Python stack and are not counted.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

SYNC_WARNING = "synchronizing CUDA operation"  # the text torch's sync debug mode warns with
FRAMES_KEPT = 8  # innermost frames that tell one calling stack from another
_SHORTENED = (("/site-packages/", ""), ("/lightning_zero/", "lightning_zero/"), ("/benchmarks/", "benchmarks/"))
_OWN_FILES = ("warnings.py", "sync_points.py")  # the frames of the warning's delivery, not of its cause


def _frame(frame: traceback.FrameSummary) -> str:
    """``package/module.py:line function``, the path cut at the installed packages or at this repository's folders."""
    path = frame.filename
    for marker, kept in _SHORTENED:
        if marker in path:
            path = kept + path.split(marker, 1)[1]
            break
    return f"{path}:{frame.lineno} {frame.name}"


class SyncPoints:
    """Counts the device synchronisations made between :meth:`enter` and :meth:`leave`, by calling stack."""

    def __init__(self, set_mode: Callable[[str], None] | None = None) -> None:
        #: torch's sync debug mode switch (another only where there is no CUDA: the tests).
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.counts: Counter[tuple[str, ...]] = Counter()
        self._catcher: Any = None
        self._shown: Any = None
        #: Whether a synchronisation made on purpose was counted (:meth:`check`): a report of none means none only then.
        self.sees: bool | None = None

    def check(self, synchronise: Any = None) -> bool:
        """Make one synchronisation (a tensor's ``item`` on the device, or ``synchronise()``) under the probe and say
        whether it was counted; the count itself is left out of the report."""
        before = self.counts.copy()
        self.enter()
        try:
            synchronise() if synchronise is not None else torch.ones((), device="cuda").item()
        finally:
            self.leave()
        self.sees = sum(self.counts.values()) > sum(before.values())
        self.counts = before
        return self.sees

    def enter(self) -> None:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        self._shown = warnings.showwarning
        warnings.showwarning = self._seen
        self.set_mode("warn")

    def leave(self) -> None:
        self.set_mode("default")
        warnings.showwarning = self._shown
        self._catcher.__exit__(None, None, None)

    def _seen(
        self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if SYNC_WARNING not in str(message):
            self._shown(message, category, filename, lineno, file, line)
            return
        stack = [f for f in traceback.extract_stack()[:-1] if os.path.basename(f.filename) not in _OWN_FILES]
        self.counts[tuple(_frame(f) for f in stack[-FRAMES_KEPT:])] += 1

    def summary(self, steps: int) -> dict[str, Any]:
        """Each calling stack's synchronisations per step, most frequent first, and whether the probe saw its own."""
        stacks = [{"per_step": n / max(1, steps), "stack": list(stack)} for stack, n in self.counts.most_common()]
        return {"sees": self.sees, "stacks": stacks}


def print_sync_points(reports: dict[str, dict[str, Any] | None], title: str) -> None:
    """One block per system: its synchronisations per step, each with the stack that made it (innermost last)."""
    shown = {system: report for system, report in reports.items() if report is not None}
    if not shown:
        return
    print(f"\n{title}")
    for system, report in shown.items():
        stacks = report["stacks"]
        total = sum(entry["per_step"] for entry in stacks)
        seen = {True: "it counted one made on purpose", False: "IT MISSED ONE MADE ON PURPOSE", None: "not checked"}
        print(f"\n{system}: {total:.1f} synchronisations a step from {len(stacks)} stack(s) ({seen[report['sees']]})")
        for entry in stacks[:12]:
            print(f"  {entry['per_step']:.1f} a step:")
            for frame in entry["stack"]:
                print(f"      {frame}")
