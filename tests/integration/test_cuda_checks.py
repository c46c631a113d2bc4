"""benchmarks/cuda_checks.py: refuses clearly without CUDA, and its checks pass on the CPU through its development
switch (`make test-all`), so that the script a GPU session runs has not rotted in between."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration import background

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cuda_checks.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import cuda_checks  # noqa: E402
import cuda_features  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda(capsys) -> None:
    assert cuda_checks.main([]) == 2
    assert "needs a CUDA device (or --accelerator cpu)" in capsys.readouterr().err
    assert cuda_features.main([]) == 2
    assert "needs a CUDA device (or --accelerator cpu)" in capsys.readouterr().err


@background.in_background
def test_every_feature_row_passes_on_the_cpu() -> None:
    """benchmarks/cuda_features.py, the device's feature rows, through its CPU switch: each row ran and passed."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cuda_features.py"), "--accelerator", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and line.endswith(" |")]
    kinds = {row[0][2:] for row in rows[1:]}  # after the header
    assert kinds == {"vs ddp", "vs plain", "offloaded", "trains", "resumed", "monitor"}, rows
    assert all(row[-1] == "ok |" for row in rows[1:]) and len(rows) - 1 == 30, rows


@pytest.mark.full
def test_every_check_passes_on_the_cpu() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--accelerator", "cpu"], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| 32-true | stage")]
    assert len(rows) == len(cuda_checks.CASES)
    started = {row[1]: int(row[2]) for row in rows}
    assert started["stage1"] > 0 and started["stage2"] > 0  # the host stepped parts during backward
    assert started["stage1_clip"] == 0  # clipping needs every gradient first
    averaged = [line for line in result.stdout.splitlines() if line.endswith("| 0.0e+00 | 0.0e+00 |")]
    assert len(averaged) == len(cuda_checks.AVERAGING)  # EMA resumed exactly from both kinds of checkpoint
    evaluated = [line for line in result.stdout.splitlines() if line.count("|") == 3 and line.endswith("| 0.0e+00 |")]
    assert len(evaluated) == len(cuda_checks.EVALUATED_FIRST)  # each fit after validate and predict as the fit alone
    assert "all checks passed" in result.stdout
