"""bench_core.py's phase breakdown for every system, from real 2-rank runs of the quick model: a benchmark smoke run,
in `make test-all` (the breakdown's arithmetic is tests/unit/test_bench_phases.py's, in `make test`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration import background
from tests.launch import REPO

pytestmark = pytest.mark.full

SYSTEMS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")


def breakdown_run(root) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_core.py",
            "--quick",
            "--systems",
            ",".join(SYSTEMS),
            "--steps",
            "1",
            "--warmup",
            "1",
            "--profile-steps",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "Phase breakdown" in result.stdout
    return {
        r["system"]: r for r in map(json.loads, (line for line in result.stdout.splitlines() if line.startswith("{")))
    }


background.register("bench_phases", breakdown_run, full=True)


@pytest.fixture(scope="module")
def breakdown(runs) -> dict:
    return runs.get("bench_phases").result()


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_rank_of_every_system_has_a_breakdown(breakdown, system):
    phases = breakdown[system]["phases_ms"]
    assert len(phases) == 2
    for rank in phases:
        assert rank["forward"] > 0 and rank["backward"] > 0 and rank["step"] > 0
        assert rank["total"] == pytest.approx(
            sum(rank[c] for c in ("forward", "backward", "step", "param_gather", "comm", "idle"))
        )


def test_parameter_gathers_are_where_each_system_does_them(breakdown):
    for rank in breakdown["ddp"]["phases_ms"]:
        assert rank["param_gather"] == 0  # DDP keeps whole parameters and all-reduces gradients
    for system in ("zero1", "zero2", "zero3", "fsdp2"):  # the post-step all-gather, or FSDP2's unshards
        assert all(rank["param_gather"] > 0 for rank in breakdown[system]["phases_ms"]), system
