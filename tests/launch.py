"""Run a worker script on N local processes the way ``torchrun`` does (one process group per launch,
shared by every ``Trainer`` the script builds), and collect what rank 0 reports.

Starting Python and importing torch is the main cost of a multi-process test on 2 cores, so each test
module launches once and checks many cases from the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchError(RuntimeError):
    pass


#: Environment variables a pooled rank program may be given per launch (read when its cases run, not when a
#: process starts); a launch with any other variable starts processes of its own.
POOLED_ENV = {"LZ_SHARED_DIR", "LZ_CASES"}


def rank_env(rank: int, nprocs: int, nodes: int, port: int, extra: dict | None = None) -> dict:
    """The environment of one rank, as ``torchrun`` sets it (``nodes`` simulated nodes of consecutive ranks)."""
    per_node = nprocs // nodes
    return dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(nprocs),
        RANK=str(rank),
        LOCAL_RANK=str(rank % per_node),
        NODE_RANK=str(rank // per_node),
        LZ_NODES=str(nodes),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        **(extra or {}),
    )


def start_rank(module: str, args, env: dict, log, fds: dict[int, int] | None = None):
    """``python -m module args`` as one rank, its stdout and stderr into ``log`` (a file): forked from
    ``tests/forkserver.py``'s server, which has imported torch and Lightning already, or, with
    ``LZ_FRESH_PROCESSES=1``, a new Python process. ``fds``: more descriptors the rank gets, by number."""
    if os.environ.get("LZ_FRESH_PROCESSES") == "1":
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=(fds or {}).get(0),
            pass_fds=[fd for n, fd in (fds or {}).items() if n > 2],
        )
    from tests import forkserver

    return forkserver.start(module, list(args), env=env, cwd=REPO, stdout=log.fileno(), fds=fds)


def launch(
    module: str,
    *args: str,
    nprocs: int = 2,
    timeout: float = 600,
    env: dict | None = None,
    nodes: int = 1,
    fresh: bool = False,
) -> dict:
    """Run ``python -m module args`` on ``nprocs`` ranks; return rank 0's JSON report.

    ``nodes`` simulates that many nodes of ``nprocs / nodes`` consecutive ranks each (``NODE_RANK`` and
    ``LOCAL_RANK`` as a multi-node launcher sets them; the worker sees it as ``LZ_NODES``). The ranks are the
    session's pool of that size (``tests/pool.py``) unless ``fresh`` (for a program that needs processes of its
    own) or ``env`` holds more than :data:`POOLED_ENV`; then they are processes of their own (:func:`start_rank`).
    ``LZ_FRESH_PROCESSES=1`` makes every launch new Python processes, as before the pool and the fork server.

    Raises :class:`LaunchError` with every rank's output if a rank fails or the run exceeds ``timeout``.
    """
    if not fresh and set(env or {}) <= POOLED_ENV and os.environ.get("LZ_FRESH_PROCESSES") != "1":
        from tests.pool import PoolError, pool

        port = free_port()
        ranks = pool(nprocs, nodes, lambda rank, n, k: rank_env(rank, n, k, port))
        try:
            return ranks.run(module, args, env or {}, timeout)
        except PoolError as error:
            raise LaunchError(str(error)) from None
    return _launch_fresh(module, args, nprocs, timeout, env, nodes)


def _launch_fresh(module: str, args: tuple, nprocs: int, timeout: float, env: dict | None, nodes: int) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="lz-launch-"))
    report = out_dir / "report.json"
    port = free_port()
    procs = []
    logs = []
    for rank in range(nprocs):
        log = open(out_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(
            start_rank(
                module, args, rank_env(rank, nprocs, nodes, port, {"LZ_REPORT": str(report), **(env or {})}), log
            )
        )
    deadline = time.monotonic() + timeout
    try:
        codes = [proc.wait(timeout=max(0.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        message = f"{module} timed out after {timeout}s (a hang)\n{_logs(logs)}"
        shutil.rmtree(out_dir, ignore_errors=True)
        raise LaunchError(message) from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    try:
        if any(codes):
            raise LaunchError(f"{module} failed with exit codes {codes}\n{_logs(logs)}")
        if not report.exists():
            raise LaunchError(f"{module} wrote no report\n{_logs(logs)}")
        return json.loads(report.read_text())
    finally:
        for log in logs:
            log.close()
        shutil.rmtree(out_dir, ignore_errors=True)


def _logs(logs) -> str:
    parts = []
    for rank, log in enumerate(logs):
        log.flush()
        log.seek(0)
        parts.append(f"----- rank {rank} -----\n{log.read()[-6000:]}")
    return "\n".join(parts)


@dataclass
class RankRun:
    """One rank of :func:`launch_processes`: exit code (None if it had to be killed at ``timeout``), output,
    and when it exited, in seconds since the launch."""

    code: int | None
    output: str
    exited_at: float


@dataclass
class FaultRun:
    ranks: list[RankRun]
    fault_at: float | None  # seconds since the launch when the worker injected its fault (LZ_FAULT_FILE)
    signalled_at: float | None  # when the harness sent `signal_on_fault`'s signal
    report_text: str | None  # what rank 0 wrote with :func:`write_report`, if it wrote anything

    def report(self) -> dict:
        """What rank 0 wrote with :func:`write_report`."""
        if self.report_text is None:
            raise FileNotFoundError("rank 0 wrote no report")
        return json.loads(self.report_text)

    def output(self, rank: int) -> str:
        return self.ranks[rank].output

    def since_fault(self, rank: int) -> float:
        return self.ranks[rank].exited_at - (self.fault_at or 0.0)


def launch_processes(
    module: str,
    *args: str,
    nprocs: int = 2,
    timeout: float = 120,
    env: dict | None = None,
    signal_on_fault: int | None = None,
) -> FaultRun:
    """Run ``python -m module args`` on ``nprocs`` ranks and return every rank's exit code, output and exit time,
    whether or not they fail (for fault tests; :func:`launch` raises instead).

    A worker announces its fault by writing ``time.time()`` to the file ``$LZ_FAULT_FILE``. With
    ``signal_on_fault``, that signal goes to every rank still running as soon as the file appears (a
    scheduler's SIGTERM). A rank left stopped (SIGSTOP) once every other rank has exited gets SIGCONT, so it
    can show how it ends. Ranks still running at ``timeout`` are killed (code None).
    """
    import signal as signals

    out_dir = Path(tempfile.mkdtemp(prefix="lz-fault-"))
    fault_file = out_dir / "fault"
    port = free_port()
    procs, logs = [], []
    start = time.monotonic()
    wall_start = time.time()
    for rank in range(nprocs):
        extra = {"LZ_FAULT_FILE": str(fault_file), "LZ_REPORT": str(out_dir / "report.json"), **(env or {})}
        log = open(out_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(start_rank(module, args, rank_env(rank, nprocs, 1, port, extra), log))
    exited: dict[int, float] = {}
    signalled_at = None
    continued = set()
    # Polling is the harness's job here: several processes, a file and signals, all bounded by `timeout`.
    while len(exited) < nprocs and time.monotonic() - start < timeout:
        for rank, proc in enumerate(procs):
            if rank not in exited and proc.poll() is not None:
                exited[rank] = time.monotonic() - start
        if signal_on_fault is not None and signalled_at is None and fault_file.exists():
            signalled_at = time.monotonic() - start
            for rank, proc in enumerate(procs):
                if rank not in exited:
                    proc.send_signal(signal_on_fault)
        running = [r for r in range(nprocs) if r not in exited]
        if running and all(_stopped(procs[r].pid) for r in running):
            for rank in running:
                if rank not in continued:
                    continued.add(rank)
                    procs[rank].send_signal(signals.SIGCONT)
        time.sleep(0.05)
    for rank, proc in enumerate(procs):
        if rank not in exited:
            proc.kill()
            proc.wait()
    fault_at = None
    if fault_file.exists():
        text = fault_file.read_text().split()
        fault_at = float(text[0]) - wall_start if text else None
    ranks = []
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        log.flush()
        log.seek(0)
        ranks.append(RankRun(proc.returncode if rank in exited else None, log.read(), exited.get(rank, timeout)))
        log.close()
    report = out_dir / "report.json"
    report_text = report.read_text() if report.exists() else None
    shutil.rmtree(out_dir, ignore_errors=True)
    return FaultRun(ranks, fault_at, signalled_at, report_text)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def write_report(data: dict) -> None:
    """Called by rank 0 of a worker."""
    Path(os.environ["LZ_REPORT"]).write_text(json.dumps(data))


@contextlib.contextmanager
def _timed(group: str):
    """Each group's wall time in the rank's output (the pool keeps it in a log per command): where a launch spends
    its time, for whoever trims the suite."""
    start = time.perf_counter()
    yield
    print(f"[group] {group}: {time.perf_counter() - start:.1f} s", flush=True)


def run_cases(cases: dict, groups: list[str]) -> None:
    """Main of a rank program: run each group's cases; rank 0 reports, including the traceback of a group
    that failed (which then fails the launch)."""
    import traceback

    import torch

    torch.set_num_threads(1)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    report = {}
    for group in groups:
        try:
            with _timed(group):
                report[group] = cases[group]()
        except Exception:
            report[group] = {"error": traceback.format_exc()}
            if rank0:
                write_report(report)
            raise
    if rank0:
        write_report(report)


def ensure_process_group() -> None:
    """For rank programs that talk to torch.distributed without a Trainer: the process group, unless an earlier
    program of the same pool (``tests/pool.py``) created it already; it lives as long as the process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")


def run_cases_with_directory(cases: dict, groups: list[str]) -> None:
    """Main of a rank program whose cases take a directory shared by the ranks (and by later launches
    when ``LZ_SHARED_DIR`` is set); rank 0 reports."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(os.environ.get("LZ_SHARED_DIR", tmp))
        report = {}
        for group in groups:
            with _timed(group):
                report[group] = cases[group](directory)
    if int(os.environ.get("RANK", "0")) == 0:
        write_report(report)
