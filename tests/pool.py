"""Rank processes that outlive one test module: :func:`tests.launch.launch` sends each rank program to a pool of
``nprocs`` processes (``tests/pool_worker.py``) instead of starting new ones, as torch's own suite does with
``MultiProcContinuousTest``.

Creating the process group and running a first ``Trainer`` costs each launch seconds per rank; a pool pays it once
per session and size (its ranks come from ``tests/forkserver.py``, with torch and Lightning imported already). Rank programs already create
one process group and share it between every ``Trainer`` they build, so running them one after another in
the same processes changes nothing they rely on. A command that fails, or outlives its timeout, ends the pool
(its ranks may be left inside a collective); the next command starts a new one.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.launch import start_rank

#: After one rank reports a failure, how long the others get to report theirs before the pool is ended.
_FAILURE_GRACE = 30.0
#: The descriptor a pool rank reports on (its stdin brings the commands).
_CONTROL_FD = 3


class PoolError(RuntimeError):
    pass


class Pool:
    def __init__(self, nprocs: int, nodes: int, rank_env: Callable[[int, int, int], dict]) -> None:
        self.nprocs, self.nodes = nprocs, nodes
        self.out_dir = Path(tempfile.mkdtemp(prefix="lz-pool-"))
        self.procs: list[subprocess.Popen] = []
        self.control: list[int] = []
        self.logs = [self.out_dir / f"rank{rank}.log" for rank in range(nprocs)]
        self.commands = 0
        self.stdin: list = []
        for rank in range(nprocs):
            read_fd, write_fd = os.pipe()
            stdin_read, stdin_write = os.pipe()
            with open(self.logs[rank], "w") as log:
                self.procs.append(
                    start_rank(
                        "tests.pool_worker",
                        [str(_CONTROL_FD)],
                        rank_env(rank, nprocs, nodes),
                        log,
                        fds={0: stdin_read, _CONTROL_FD: write_fd},
                    )
                )
            os.close(write_fd)
            os.close(stdin_read)
            self.control.append(read_fd)
            self.stdin.append(os.fdopen(stdin_write, "w"))

    def run(self, module: str, args: tuple[str, ...], env: dict, timeout: float) -> dict:
        """Run ``python -m module args`` on every rank of the pool; rank 0's report."""
        self.commands += 1
        report = self.out_dir / f"report-{self.commands}.json"
        logs = [self.out_dir / f"command-{self.commands}-rank{rank}.log" for rank in range(self.nprocs)]
        line = (
            json.dumps(
                {
                    "module": module,
                    "args": list(args),
                    "env": env,
                    "report": str(report),
                    "logs": [str(path) for path in logs],
                }
            )
            + "\n"
        )
        for stdin in self.stdin:
            stdin.write(line)
            stdin.flush()
        outcome = self._wait(timeout)
        if outcome != "ok" or not report.exists():
            what = outcome if outcome != "ok" else "wrote no report"
            failure = f"{module} {' '.join(args)}: {what}\n{self._logs(logs)}"
            self.close()
            raise PoolError(failure)
        result = json.loads(report.read_text())
        report.unlink()  # read; the command's logs stay until the pool closes
        return result

    def _wait(self, timeout: float) -> str:
        """ "ok" when every rank finished the command, else what went wrong."""
        deadline = time.monotonic() + timeout
        pending = set(range(self.nprocs))
        failed: list[int] = []
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return (
                    f"rank(s) {sorted(failed)} failed and rank(s) {sorted(pending)} did not finish within "
                    f"{_FAILURE_GRACE:g} s"
                    if failed
                    else f"timed out after {timeout:g} s (a hang)"
                )
            ready, _, _ = select.select([self.control[r] for r in pending], [], [], remaining)
            for rank in [r for r in pending if self.control[r] in ready]:
                pending.discard(rank)
                if os.read(self.control[rank], 64).decode().strip() != "ok":
                    failed.append(rank)
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE)
        return f"rank(s) {sorted(failed)} failed" if failed else "ok"

    def _logs(self, logs: list[Path]) -> str:
        """Each rank's output of the command, or of its start where it died before the command began."""
        parts = []
        for rank, path in enumerate(logs):
            path = path if path.exists() else self.logs[rank]
            parts.append(f"----- rank {rank} -----\n{path.read_text(errors='replace')[-6000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for stdin in self.stdin:
            try:
                stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self.control:
            try:
                os.close(fd)
            except OSError:
                pass
        self.control = []
        shutil.rmtree(self.out_dir, ignore_errors=True)  # the logs a failure needed are in its PoolError
        if _POOLS.get((self.nprocs, self.nodes)) is self:
            del _POOLS[(self.nprocs, self.nodes)]


_POOLS: dict[tuple[int, int], Pool] = {}


def pool(nprocs: int, nodes: int, rank_env: Callable[[int, int, int], dict]) -> Pool:
    """The session's pool of this size (started on first use)."""
    found = _POOLS.get((nprocs, nodes))
    if found is None or any(proc.poll() is not None for proc in found.procs):
        if found is not None:
            found.close()
        found = _POOLS[(nprocs, nodes)] = Pool(nprocs, nodes, rank_env)
    return found


@atexit.register
def close_all() -> None:
    for each in list(_POOLS.values()):
        each.close()
    _POOLS.clear()
