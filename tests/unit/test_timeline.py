"""benchmarks/timeline.py: the lane arithmetic (busy time as the union of a lane's events, the part of it beside
the reference lane) on intervals whose answers are known."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from timeline import _merged, _overlap, _total  # noqa: E402


def test_nested_and_touching_events_count_once():
    spans = _merged([(10, 20), (0, 5), (12, 15), (20, 25), (30, 31)])
    assert spans == [(0, 5), (10, 25), (30, 31)] and _total(spans) == 21


def test_overlap_is_the_length_of_the_intersection():
    host = _merged([(0, 10), (20, 30)])
    compute = _merged([(5, 25), (29, 40)])
    assert _overlap(host, compute) == 5 + 5 + 1 == _overlap(compute, host)
    assert _overlap(host, []) == 0 and _overlap(host, host) == _total(host)
