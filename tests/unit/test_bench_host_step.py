"""benchmarks/bench_host_step.py: the GPT-like tensors it steps hold exactly the elements asked for."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_host_step import gpt_shapes  # noqa: E402


@pytest.mark.parametrize("total, tensors", [(10**7, 128), (10**8, 128), (10**6, 40), (12_345, 1), (12_345, 7)])
def test_gpt_shapes_hold_exactly_the_elements_asked_for(total, tensors):
    shapes = gpt_shapes(total, tensors)
    assert sum(math.prod(s) for s in shapes) == total
    assert all(math.prod(s) > 0 for s in shapes)
    if tensors >= 16:
        assert abs(len(shapes) - tensors) <= 0.05 * tensors
    else:
        assert len(shapes) == tensors
