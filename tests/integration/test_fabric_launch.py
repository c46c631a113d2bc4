"""``lightning_zero.fabric.ZeroStrategy`` launched by Fabric itself with ``start_method="spawn"``
(``fabric.launch(fn)``), as a user's script runs it: it trains, and a rank's failure is named by the rank it brings down (the launcher wraps ``fn``, as torch's spawned processes catch the error before the
interpreter's hook would). The torchrun-style launches are tests/distributed/test_fabric.py's."""

from __future__ import annotations

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


def test_spawned_fabric_loop_trains_and_a_rank_failure_is_named_by_the_others(tmp_path):
    """One launch: the loop's first step trains on both ranks (its loss printed by rank 0), then rank 1 raises."""
    result = _run("fails", tmp_path / "out.json")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "step 0 loss" in output
    assert "rank 1 raised RuntimeError: rank 1's batch could not be read" in output
