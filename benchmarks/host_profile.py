"""Where a step's host time goes, by the code that spends it: ours, FSDP2's, Lightning's, autograd's.

``cProfile`` on the training thread over a few steps; each function's self time (``tottime``) is charged to the
package its file belongs to, so a category's figure is time spent *in* that package's Python, not below it. C++
built-ins form categories of their own: the autograd engine's ``run_backward`` (the backward kernels and the
engine's bookkeeping, without the Python hooks it calls, which are charged to their own files), torch's operators,
and c10d's collectives. The profiler slows Python more than C++, so the figures rank the categories and size
their shares; the timed steps (run without it) give the step time.
"""

from __future__ import annotations

import cProfile
import os
import pstats
from collections import defaultdict
from typing import Any

import lightning_zero

#: Our package's directory, as the profiler names its files: a clone is often itself called ``lightning_zero``,
#: so ``/lightning_zero/`` in a path does not mean the package (``<clone>/lightning_zero/benchmarks/`` is not ours).
_PACKAGE = os.path.dirname(lightning_zero.__file__).replace("\\", "/") + "/"
#: (category, substring of the file path), first match wins: the most specific packages first.
_FILE_CATEGORIES = (
    ("FSDP2 (torch.distributed.fsdp)", "/torch/distributed/fsdp/"),
    ("torch.distributed (Python)", "/torch/distributed/"),
    ("torch.autograd (Python)", "/torch/autograd/"),
    ("torch.optim (Python)", "/torch/optim/"),
    ("torch.nn (Python)", "/torch/nn/"),
    ("torch (other Python)", "/torch/"),
    ("Lightning", "/lightning/"),
    ("Lightning", "/lightning_utilities/"),
    ("torchmetrics", "/torchmetrics/"),
    ("benchmark harness", "/benchmarks/"),
)
_BUILTIN_CATEGORIES = (
    ("autograd engine (C++ backward)", "run_backward"),
    ("c10d collectives (C++)", "torch._C._distributed_c10d"),
    ("c10d collectives (C++)", "ProcessGroup"),
    ("c10d collectives (C++)", "Work"),
    ("torch operators (C++)", "torch."),
    ("torch operators (C++)", "Tensor"),
    ("torch operators (C++)", "TensorBase"),
)


def category(filename: str, function: str) -> str:
    """The category of one profiled function, from its file (Python) or its name (built-ins, file ``~``)."""
    if filename == "~":
        return next((name for name, key in _BUILTIN_CATEGORIES if key in function), "Python built-ins")
    path = filename.replace("\\", "/")
    if path.startswith(_PACKAGE):  # ours, by subpackage: engine/stage3/units.py -> ours: lightning_zero/engine/stage3
        parts = path[len(_PACKAGE) :].split("/")
        if parts[0] == "demo":
            return "model (demo GPT)"
        return "ours: lightning_zero/" + ("/".join(parts[:-1]) or parts[0].removesuffix(".py"))
    return next((name for name, key in _FILE_CATEGORIES if key in path), "other Python")


class HostProfile:
    """Profiles the steps between :meth:`enter` and :meth:`leave` calls; :meth:`summary` divides by ``steps``."""

    def __init__(self) -> None:
        self._profiler = cProfile.Profile()

    def enter(self) -> None:
        self._profiler.enable()

    def leave(self) -> None:
        self._profiler.disable()

    def summary(self, steps: int, top: int = 12) -> dict[str, Any]:
        """Milliseconds per step by category, and the ``top`` functions of ours by self time."""
        if dump := os.environ.get("HOST_PROFILE_DUMP"):  # the raw profile, for `python -m pstats` or snakeviz
            self._profiler.dump_stats(dump)
        stats: dict[Any, Any] = pstats.Stats(self._profiler).stats  # type: ignore[attr-defined]
        by_category: dict[str, float] = defaultdict(float)
        ours: list[tuple[float, int, str]] = []
        operators: list[tuple[float, int, str]] = []
        for (filename, line, function), (_, calls, tottime, _, _) in stats.items():
            name = category(filename, function)
            by_category[name] += tottime
            if name.startswith("ours"):
                inside = filename.replace("\\", "/").removeprefix(_PACKAGE)  # engine/shard.py
                ours.append((tottime, calls, f"{inside}:{line}({function})"))
            elif name == "torch operators (C++)":
                operators.append((tottime, calls, function))
        scale = 1e3 / steps
        ours.sort(reverse=True)
        operators.sort(reverse=True)
        return {
            "ms_per_step": {k: v * scale for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "total_ms_per_step": sum(by_category.values()) * scale,
            "top_ours": [(f, ms * scale, calls / steps) for ms, calls, f in ours[:top]],
            "top_operators": [(f, ms * scale, calls / steps) for ms, calls, f in operators[:top]],
        }


def print_profiles(summaries: dict[str, dict[str, Any] | None], title: str) -> None:
    """A markdown table of :meth:`HostProfile.summary` results, one column per system, then each one's top functions."""
    profiles = {s: p for s, p in summaries.items() if p}
    if not profiles:
        return
    categories: dict[str, float] = {}
    for p in profiles.values():
        for name, ms in p["ms_per_step"].items():
            categories[name] = max(categories.get(name, 0.0), ms)
    shown = [c for c, ms in sorted(categories.items(), key=lambda kv: -kv[1]) if ms >= 0.05]
    print(f"\n## {title}\n")
    print("| package | " + " | ".join(profiles) + " |")
    print("|---|" + "---|" * len(profiles))
    for name in shown:
        print(f"| {name} | " + " | ".join(f"{p['ms_per_step'].get(name, 0.0):.2f}" for p in profiles.values()) + " |")
    print("| **total** | " + " | ".join(f"{p['total_ms_per_step']:.2f}" for p in profiles.values()) + " |")
    for system, p in profiles.items():
        for key, what in (("top_ours", "our costliest functions"), ("top_operators", "costliest torch operators")):
            if p.get(key):
                print(f"\n{system}: {what} (self ms per step, calls per step)")
                for function, ms, calls in p[key]:
                    print(f"  {ms:7.3f} ms  {calls:7.1f}  {function}")
