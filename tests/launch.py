"""Run a worker script on N local processes the way ``torchrun`` does (one process group per launch,
shared by every ``Trainer`` the script builds), and collect what rank 0 reports.

Starting Python and importing torch is the main cost of a multi-process test on 2 cores, so each test
module launches once and checks many cases from the report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchError(RuntimeError):
    pass


def launch(module: str, *args: str, nprocs: int = 2, timeout: float = 600, env: dict | None = None) -> dict:
    """Run ``python -m module args`` on ``nprocs`` ranks; return rank 0's JSON report.

    Raises :class:`LaunchError` with every rank's output if a rank fails or the run exceeds ``timeout``.
    """
    out_dir = Path(tempfile.mkdtemp(prefix="lz-launch-"))
    report = out_dir / "report.json"
    port = free_port()
    procs = []
    logs = []
    for rank in range(nprocs):
        rank_env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(nprocs),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            LZ_REPORT=str(report),
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            OMP_NUM_THREADS="1",
            **(env or {}),
        )
        log = open(out_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(
            subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=rank_env, stdout=log, stderr=subprocess.STDOUT)
        )
    deadline = time.monotonic() + timeout
    try:
        codes = [proc.wait(timeout=max(0.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{module} timed out after {timeout}s (a hang)\n{_logs(logs)}") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(codes):
        raise LaunchError(f"{module} failed with exit codes {codes}\n{_logs(logs)}")
    if not report.exists():
        raise LaunchError(f"{module} wrote no report\n{_logs(logs)}")
    return json.loads(report.read_text())


def _logs(logs) -> str:
    parts = []
    for rank, log in enumerate(logs):
        log.flush()
        log.seek(0)
        parts.append(f"----- rank {rank} -----\n{log.read()[-6000:]}")
    return "\n".join(parts)


def write_report(data: dict) -> None:
    """Called by rank 0 of a worker."""
    Path(os.environ["LZ_REPORT"]).write_text(json.dumps(data))


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
            report[group] = cases[group]()
        except Exception:
            report[group] = {"error": traceback.format_exc()}
            if rank0:
                write_report(report)
            raise
    if rank0:
        write_report(report)


def run_cases_with_directory(cases: dict, groups: list[str]) -> None:
    """Main of a rank program whose cases take a directory shared by the ranks (and by later launches
    when ``LZ_SHARED_DIR`` is set); rank 0 reports."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(os.environ.get("LZ_SHARED_DIR", tmp))
        report = {group: cases[group](directory) for group in groups}
    if int(os.environ.get("RANK", "0")) == 0:
        write_report(report)
