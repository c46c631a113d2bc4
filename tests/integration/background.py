"""The commands the integration tests run as a user runs them (the examples, the main job, torchrun jobs), started
together, a few at a time, instead of one after another in each module.

Each run is a new Python process tree that spends its first seconds of CPU importing torch and Lightning, in its
launching process first and in its other ranks after, while the ranks already started wait; side by side, runs fill
the cores that one run leaves idle. A module registers its runs with :func:`register` when pytest imports it;
the ``runs`` fixture of ``tests/conftest.py`` starts those of the modules that have selected tests (when the unit
tier starts, or the first integration test), and a test reads a run with ``runs.get(name).result()`` (which
re-raises what the run raised, its assertions included).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Runs at once. Three keep 2 cores busy through the runs' single-process phases (imports, a launcher starting
#: its ranks) without making any run wait long for a core.
WORKERS = 3


@dataclass(frozen=True)
class _Registered:
    run: Callable[[Path], Any]
    file: str  # the test module that reads it


_REGISTERED: dict[str, _Registered] = {}


def register(name: str, run: Callable[[Path], Any]) -> None:
    """``run(folder)`` is a command of the module that defines ``run``; ``folder`` is a fresh folder of its own."""
    if name in _REGISTERED and _REGISTERED[name].run is not run:
        raise ValueError(f"two integration runs are named {name!r}")
    _REGISTERED[name] = _Registered(run, str(Path(sys.modules[run.__module__].__file__).resolve()))


@dataclass(frozen=True)
class Started:
    future: Future
    root: Path  # the folder the run was given

    def result(self) -> Any:
        return self.future.result()


class Runs:
    """The session's runs: started for the selected test modules when this is made, or when first asked for."""

    def __init__(self, make_folder: Callable[[str], Path], selected_files: set[str]) -> None:
        self._make_folder = make_folder
        self._executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="integration-run")
        self._started: dict[str, Started] = {}
        for name, registered in _REGISTERED.items():
            if registered.file in selected_files:
                self.get(name)

    def get(self, name: str) -> Started:
        if name not in self._started:
            root = self._make_folder(name)
            self._started[name] = Started(self._executor.submit(_REGISTERED[name].run, root), root)
        return self._started[name]

    def close(self) -> None:
        """Waits for the runs under way (each has a timeout of its own); drops those not started."""
        self._executor.shutdown(wait=True, cancel_futures=True)
