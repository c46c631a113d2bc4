"""The README's main job, run the way a user runs it (Lightning's popen launcher re-runs the script)."""

import re
import subprocess
import sys

import pytest

from tests.launch import REPO

pytestmark = pytest.mark.slow


def test_gpt_zero3_example_trains_and_its_loss_falls():
    result = subprocess.run(
        [sys.executable, "examples/gpt_zero3.py", "--max-steps", "40"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", result.stdout)
    assert summary, result.stdout[-3000:]
    first, last = map(float, summary.groups())
    assert last < first - 0.5, summary.group(0)


def test_estimate_command_prints_every_stage():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_zero", "estimate", "--params", "1e9", "--devices", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: float(line.split()[1]) for line in result.stdout.splitlines() if line.startswith(("ddp", "zero"))}
    gib = 2**30
    assert rows["ddp"] == pytest.approx(16e9 / gib, abs=0.01)
    assert rows["zero1"] == pytest.approx((8e9 + 8e9 / 8) / gib, abs=0.01)
    assert rows["zero2"] == pytest.approx((4e9 + 12e9 / 8) / gib, abs=0.01)
    assert rows["zero3"] == pytest.approx(16e9 / 8 / gib, abs=0.01)
