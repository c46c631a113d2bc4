"""The type check (mypy, with the ``[mypy]`` settings of ``setup.cfg``), which also checks each engine against the
engine contract (the end of each engine module), run as one of the session's runs: a cold mypy spends about a
minute of one core, which beside the other runs costs the session far less than before the first test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import background
from tests.launch import REPO

pytestmark = pytest.mark.slow


def type_check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=900)


background.register("type_check", type_check)


def test_the_package_type_checks(runs):
    import lightning

    if tuple(int(part) for part in lightning.__version__.split(".")[:2]) < (2, 6):
        # make test-torch's Lightning 2.5 entry: the package imports 2.6's weight averaging callbacks optionally, and
        # is typed against them; 2.5 runs the same code without them (the other cases), but its types differ there.
        pytest.skip(f"typed against Lightning 2.6's callbacks; this is Lightning {lightning.__version__}")
    result = runs.get("type_check").result()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert result.stdout.startswith("Success: no issues found"), result.stdout[-3000:]
