"""benchmarks/sync_points.py: the host's waits for the device counted by calling stack. torch's sync debug mode
needs CUDA; its warning is raised here by hand, as torch raises it, so the counting is checked on the CPU."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sync_points import SyncPoints  # noqa: E402


def _item_like() -> None:
    warnings.warn("called a synchronizing CUDA operation", UserWarning)


def test_each_synchronisation_is_counted_by_its_stack_and_other_warnings_pass_through():
    points = SyncPoints()
    points._catcher = warnings.catch_warnings(record=True)
    passed = points._catcher.__enter__()
    warnings.simplefilter("always")
    points._shown = warnings.showwarning
    warnings.showwarning = points._seen
    try:
        for _ in range(4):
            _item_like()
        _item_like()
        warnings.warn("something else")
    finally:
        warnings.showwarning = points._shown
        points._catcher.__exit__(None, None, None)
    report = points.summary(steps=2)
    assert [entry["per_step"] for entry in report] == [2.0, 0.5]  # the loop's line, then the single call's
    assert all(entry["stack"][-1].endswith(" _item_like") for entry in report)
    assert [str(w.message) for w in passed] == ["something else"]
