"""The commands the integration tests run as a user runs them (the examples, the main job, torchrun jobs), started
together, a few at a time, instead of one after another in each module.

Each run is a new Python process tree that spends its first seconds of CPU importing torch and Lightning, in its
launching process first and in its other ranks after, while the ranks already started wait; side by side, runs fill
the cores that one run leaves idle. A module registers its runs with :func:`register` when pytest imports it;
the ``runs`` fixture of ``tests/conftest.py`` starts those of the modules that have selected tests (when the unit
tier starts, or the first integration test), and a test reads a run with ``runs.get(name).result()`` (which
re-raises what the run raised, its assertions included). A run registered with ``full=True`` is read only by tests
marked ``full`` (``make test-all``) and starts only when one of its module's ``full`` tests is selected;
:func:`in_background` makes a whole ``full`` test such a run.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: Runs at once (``LZ_INTEGRATION_WORKERS`` overrides it). Two fill the core a run's single-process phases (imports,
#: a launcher starting its ranks) leave idle; a third made the session slower on 2 cores (benchmarks/results/
#: 2026-11-27-test-suite.md): the distributed tier's 2-rank programs wait at every collective for a descheduled rank.
WORKERS = int(os.environ.get("LZ_INTEGRATION_WORKERS", "2"))


@dataclass(frozen=True)
class _Registered:
    run: Callable[[Path], Any]
    file: str  # the test module that reads it
    full: bool  # read only by tests marked `full`


_REGISTERED: dict[str, _Registered] = {}


def register(name: str, run: Callable[[Path], Any], *, full: bool = False) -> None:
    """``run(folder)`` is a command of the module that defines ``run``; ``folder`` is a fresh folder of its own."""
    if name in _REGISTERED and _REGISTERED[name].run is not run:
        raise ValueError(f"two integration runs are named {name!r}")
    _REGISTERED[name] = _Registered(run, str(Path(sys.modules[run.__module__].__file__).resolve()), full)


def in_background(test: Callable[[Path], None]) -> Callable:
    """A ``full`` test whose whole body (its commands and its checks, given a fresh folder for ``tmp_path``) runs as
    a registered run beside the rest of the session; the test itself waits for it and re-raises what it raised."""
    name = f"{test.__module__}.{test.__name__}"
    takes_folder = bool(inspect.signature(test).parameters)

    def run(folder: Path) -> None:
        test(folder) if takes_folder else test()

    run.__module__ = test.__module__  # the module whose selected tests start it
    register(name, run, full=True)

    def wait_for_run(runs: Runs) -> None:
        runs.get(name).result()

    wait_for_run.__name__, wait_for_run.__qualname__, wait_for_run.__doc__ = (
        test.__name__,
        test.__qualname__,
        test.__doc__,
    )
    wait_for_run.__module__ = test.__module__
    return pytest.mark.full(wait_for_run)


@dataclass(frozen=True)
class Started:
    future: Future
    root: Path  # the folder the run was given

    def result(self) -> Any:
        return self.future.result()


class Runs:
    """The session's runs: started for the selected test modules when this is made, or when first asked for.

    ``selected_files``: the modules with selected tests; ``selected_full_files``: those with selected ``full`` tests.
    The ``full`` runs start first: they are the longest.
    """

    def __init__(
        self, make_folder: Callable[[str], Path], selected_files: set[str], selected_full_files: set[str] = frozenset()
    ) -> None:
        self._make_folder = make_folder
        self._executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="integration-run")
        self._started: dict[str, Started] = {}
        #: (run, started, ended) in ``time.monotonic()`` seconds, for the session's timeline (tests/conftest.py).
        self.timeline: list[tuple[str, float, float]] = []
        for full, files in ((True, selected_full_files), (False, selected_files)):
            for name, registered in _REGISTERED.items():
                if registered.full == full and registered.file in files:
                    self.get(name)

    def get(self, name: str) -> Started:
        if name not in self._started:
            root = self._make_folder(name)
            self._started[name] = Started(self._executor.submit(self._timed, name, root), root)
        return self._started[name]

    def _timed(self, name: str, root: Path) -> Any:
        started = time.monotonic()
        try:
            return _REGISTERED[name].run(root)
        finally:
            self.timeline.append((name, started, time.monotonic()))

    def close(self) -> None:
        """Waits for the runs under way (each has a timeout of its own); drops those not started."""
        self._executor.shutdown(wait=True, cancel_futures=True)
