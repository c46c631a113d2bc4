"""The session's order, and the integration tier's runs.

Tests marked ``alone`` run first (the fault tests that bound how soon a hung run must end, and tests that measure
time), then those marked ``many_ranks`` (4 ranks on 2 cores: each collective waits until every rank has been
scheduled, so they slow down most when anything else runs), then the tiers in the order unit, distributed,
integration. The integration tier's runs (real commands in new processes, ``tests/integration/background.py``) start
with the first unit test and proceed beside the rest: a unit test uses one core, and a 2-rank test program leaves a
core idle whenever one rank waits for the other; the integration tests, last, read what the runs left.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration import background

# The session starts processes from several threads at once (background.py's runs, beside the pool's and the fork
# server's threads). CPython starts them with vfork, whose child borrows the parent's memory until it execs; once in
# five make test-all runs a torchrun launch from a run's thread failed in execve with EFAULT ("[Errno 14] Bad
# address") before any process ran. fork + exec gives the child its own copy, at the cost of copying page tables.
subprocess._USE_VFORK = False  # type: ignore[attr-defined]

# ATen's scalar kernels, here and in every process the tests start (they inherit this environment; set before the
# first torch operation, which fixes the choice): the mixed-precision emulations reproduce our arithmetic, not the
# order in which a vector kernel adds its lanes, which on some CPUs (AVX2) depends on how the inputs are laid out.
# One bf16 sum rounded the other way, then Adam's normalisation, moved Hugging Face GPT-2's weights 1e-5 from the
# emulation there (benchmarks/results/2026-11-27-test-suite.md, thirtieth session).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")
# The libraries beneath ATen pick their kernels by the CPU too, so the same test rounds differently on another machine
# of this kind: MKL's GEMMs (MKL_CBWR pins its code path; AVX2 is on every x86 machine this project runs on) and
# oneDNN's (capped at AVX2 as well). The cap also avoids a torch 2.13 defect: on a CPU with AMX, bf16
# scaled_dot_product_attention packs its inputs for AMX, which ATen's default capability then refuses ("pack_vnni2
# is only supported when avx512 is supported": every bf16 attention of the suite failed on such a machine).
os.environ.setdefault("MKL_CBWR", "AVX2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

TIERS = ("unit", "distributed", "integration")
#: Markers of the tests that run before the tiers, in this order, without the integration runs beside them.
FIRST = ("alone", "many_ranks")
_SELECTED = pytest.StashKey[set]()
_SELECTED_FULL = pytest.StashKey[set]()


def _order(item: pytest.Item) -> int:
    for position, marker in enumerate(FIRST):
        if item.get_closest_marker(marker):
            return position
    parts = Path(item.path).resolve().relative_to(Path(__file__).resolve().parent).parts
    return len(FIRST) + (TIERS.index(parts[0]) if parts[0] in TIERS else len(TIERS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: each tier keeps pytest's order of its modules and tests


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_SELECTED] = {str(item.path.resolve()) for item in session.items}
    session.config.stash[_SELECTED_FULL] = {
        str(item.path.resolve()) for item in session.items if item.get_closest_marker("full")
    }


#: The session's timeline: when each part of the order began, and each integration run's span (``time.monotonic()``).
_PARTS: dict[str, float] = {}
_RUNS: list[tuple[str, float, float]] = []


def _part(item: pytest.Item) -> str:
    position = _order(item)
    return (*FIRST, *TIERS, "other")[position]


def pytest_runtest_setup(item: pytest.Item) -> None:
    _PARTS.setdefault(_part(item), time.monotonic())


def pytest_terminal_summary(terminalreporter) -> None:
    """Where the session's wall time went: each part of the order from its first test, each integration run."""
    if not _PARTS:
        return
    start = min(_PARTS.values())
    terminalreporter.section("timeline (s from the first test)")
    for part, began in sorted(_PARTS.items(), key=lambda kv: kv[1]):
        terminalreporter.write_line(f"{began - start:7.0f}  {part} tests begin")
    for name, began, ended in sorted(_RUNS, key=lambda run: run[1]):
        terminalreporter.write_line(f"{began - start:7.0f}  {name}: {ended - began:.0f} s")
    terminalreporter.write_line(f"{time.monotonic() - start:7.0f}  end")


@pytest.fixture(scope="session")
def runs(tmp_path_factory, pytestconfig) -> background.Runs:
    """Every registered run of the modules with selected tests, started when the first test that asks starts."""
    started = background.Runs(
        tmp_path_factory.mktemp, pytestconfig.stash.get(_SELECTED, set()), pytestconfig.stash.get(_SELECTED_FULL, set())
    )
    yield started
    started.close()
    _RUNS.extend(started.timeline)


@pytest.fixture(autouse=True)
def _environment_kept():
    """Each test leaves ``os.environ`` as it found it. Lightning writes into it in this process (``seed_everything``
    sets ``PL_GLOBAL_SEED`` and ``PL_SEED_WORKERS``, which every later Trainer's ``reset_seed`` reads back), and
    the rank processes a later launch starts inherit it."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _integration_runs_under_way(request):
    if not any(request.node.get_closest_marker(marker) for marker in FIRST):
        request.getfixturevalue("runs")


@pytest.fixture(scope="session", autouse=True)
def _shared_processes():
    """The pool's ranks and the fork server end with the last test rather than at interpreter exit, so that their
    coverage data (``make coverage``) is written before pytest-cov combines it."""
    yield
    from tests import forkserver, pool

    pool.close_all()
    forkserver.close()
