"""The session's order, and the integration tier's runs.

Tests marked ``alone`` run first (the fault tests that bound how soon a hung run must end), then the tiers in the
order distributed, unit, integration. The integration tier's runs (real commands in new processes,
``tests/integration/background.py``) start with the first test not marked ``alone`` and proceed beside the rest:
a 2-rank test program leaves a core idle whenever one rank waits for the other, and a unit test uses one core; the
integration tests, last, read what the runs left. Tests that measure time are marked ``alone`` too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import background

TIERS = ("distributed", "unit", "integration")
_SELECTED = pytest.StashKey[set]()


def _order(item: pytest.Item) -> int:
    if item.get_closest_marker("alone"):
        return 0
    parts = Path(item.path).resolve().relative_to(Path(__file__).resolve().parent).parts
    return 1 + (TIERS.index(parts[0]) if parts[0] in TIERS else len(TIERS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: each tier keeps pytest's order of its modules and tests


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_SELECTED] = {str(item.path.resolve()) for item in session.items}


@pytest.fixture(scope="session")
def runs(tmp_path_factory, pytestconfig) -> background.Runs:
    """Every registered run of the modules with selected tests, started when the first test that asks starts."""
    started = background.Runs(tmp_path_factory.mktemp, pytestconfig.stash.get(_SELECTED, set()))
    yield started
    started.close()


@pytest.fixture(autouse=True)
def _integration_runs_under_way(request):
    if not request.node.get_closest_marker("alone"):
        request.getfixturevalue("runs")


@pytest.fixture(scope="session", autouse=True)
def _shared_processes():
    """The pool's ranks and the fork server end with the last test rather than at interpreter exit, so that their
    coverage data (``make coverage``) is written before pytest-cov combines it."""
    yield
    from tests import forkserver, pool

    pool.close_all()
    forkserver.close()
