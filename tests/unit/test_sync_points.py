"""benchmarks/sync_points.py: the host's waits for the device counted by calling stack. torch's sync debug mode
needs CUDA, so the probe's mode switch is a no-op here and the warning torch would raise is raised by hand; the
counting, the passing through of other warnings and the probe's check of itself are what is tested."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sync_points import SyncPoints  # noqa: E402


def _item_like() -> None:
    warnings.warn("called a synchronizing CUDA operation", UserWarning)


def _no_switch(mode: str) -> None:
    pass


def test_each_synchronisation_is_counted_by_its_stack_and_other_warnings_pass_through():
    points = SyncPoints(set_mode=_no_switch)
    with warnings.catch_warnings(record=True) as passed:
        points.enter()
        try:
            for _ in range(4):
                _item_like()
            _item_like()
            warnings.warn("something else")
        finally:
            points.leave()
    report = points.summary(steps=2)
    assert [entry["per_step"] for entry in report["stacks"]] == [2.0, 0.5]  # the loop's line, then the single call's
    assert all(entry["stack"][-1].endswith(" _item_like") for entry in report["stacks"])
    assert [str(w.message) for w in passed] == ["something else"]
    assert report["sees"] is None  # never checked


def test_the_check_says_whether_the_probe_counts_a_synchronisation_and_leaves_it_out_of_the_report():
    points = SyncPoints(set_mode=_no_switch)
    assert points.check(_item_like) is True and points.counts == {}
    assert points.check(lambda: None) is False
    assert points.summary(steps=1) == {"sees": False, "stacks": []}
