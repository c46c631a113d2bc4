"""``lightning_zero.fabric.ZeroStrategy`` launched by Fabric itself with ``start_method="spawn"``
(``fabric.launch(fn)``), as a user's script runs it: it trains and hands rank 0's result back, and a rank's failure is
named by the rank it brings down (the launcher wraps ``fn``, as torch's spawned processes catch the error before the
interpreter's hook would). The torchrun-style launches are tests/distributed/test_fabric.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launch import REPO

pytestmark = pytest.mark.slow


def _run(mode: str, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.integration.fabric_spawned", mode, str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_spawned_fabric_loop_trains_and_returns_rank_zeros_result(tmp_path):
    result = _run("trains", tmp_path / "out.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["world_size"] == 2 and report["stage"] == 3
    assert report["losses"][-1] < report["losses"][0]


def test_spawned_rank_failure_is_named_by_the_others(tmp_path):
    result = _run("fails", tmp_path / "out.json")
    assert result.returncode != 0
    assert "rank 1 raised RuntimeError: rank 1's batch could not be read" in result.stdout + result.stderr
