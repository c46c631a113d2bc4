"""Each registered integration run of `make test` alone, one after another: its wall time and the CPU time of its
processes (reaped children: user and sys), to see what the background runs cost without the rest of the suite.

    python tests/integration/time_runs.py [NAME ...]     # from the repository root
"""

import importlib
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")

from tests.integration import background  # noqa: E402

MODULES = ["test_examples", "test_main_job", "test_multinode", "test_auto_resume", "test_cli", "test_bench_phases"]


def main(selected: list[str]) -> None:
    for module in MODULES:
        importlib.import_module(f"tests.integration.{module}")  # registers its runs
    names = [n for n, r in background._REGISTERED.items() if not r.full and (not selected or n in selected)]
    for name in names:
        root = Path(tempfile.mkdtemp(prefix=f"time-{name}-"))
        before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        try:
            background._REGISTERED[name].run(root)
            outcome = "ok"
        except Exception as error:  # noqa: BLE001 - report and go on with the next run
            outcome = f"FAILED {type(error).__name__}"
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(
            f"{name:28s} wall {time.monotonic() - started:6.1f} s  cpu {after.ru_utime - before.ru_utime:6.1f} user"
            f" + {after.ru_stime - before.ru_stime:5.1f} sys  {outcome}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
