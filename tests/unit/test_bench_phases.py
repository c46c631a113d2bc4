"""The benchmark's phase breakdown (benchmarks/phases.py) on a real profiler trace with known contents."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from phases import CATEGORIES, PhaseWindows  # noqa: E402


def _busy(seconds: float) -> float:
    """Computation for at least ``seconds``; the milliseconds it took (its last operator can run past the end)."""
    start = time.perf_counter()  # before the first operator: it is computation of the window too
    a = torch.randn(256, 256)  # operators long enough that the loop between them is a small share
    end = start + seconds
    while time.perf_counter() < end:
        a = a @ a
        a = a / a.norm()
    return (time.perf_counter() - start) * 1e3


@pytest.mark.alone  # it reads wall time: another process on the core stretches the loops' operators
def test_each_window_splits_into_computation_communication_gathers_and_idle() -> None:
    windows = PhaseWindows()
    windows.start()
    # Lightning runs forward and backward inside optimizer.step(closure): a range across windows is nobody's.
    spanning = record_function("Optimizer.step#AdamW.step")
    began = time.perf_counter()
    windows.enter("forward")
    spanning.__enter__()
    forward = _busy(0.03)
    time.sleep(0.03)  # between operators: idle
    windows.enter("backward")
    backward = _busy(0.03)
    with record_function("lightning_zero::wait"):
        time.sleep(0.04)  # a gradient reduction the computation does not hide
    windows.enter("step")
    spanning.__exit__(None, None, None)
    step = _busy(0.01)
    with record_function("lightning_zero::param_all_gather"):
        time.sleep(0.02)
    windows.leave()
    elapsed = (time.perf_counter() - began) * 1e3
    phases = windows.stop(steps=1)
    assert set(CATEGORIES) <= set(phases)
    # Labelled regions are exact; computation loses the Python between its operators to idle.
    assert phases["comm"] == pytest.approx(40, abs=6)
    assert phases["param_gather"] == pytest.approx(20, abs=5)
    # A loaded machine stretches the last operator of each loop: bound by the time each loop really took.
    assert 18 <= phases["forward"] <= forward + 1 and 18 <= phases["backward"] <= backward + 1
    assert 5 <= phases["step"] <= step + 1
    assert 28 <= phases["idle"] <= 50  # the forward's sleep, plus the loops' Python
    assert 150 <= phases["total"] <= elapsed + 2  # 160 ms of sleeps and loops at least, stretched by a loaded machine
    assert phases["total"] == pytest.approx(sum(phases[c] for c in CATEGORIES))
