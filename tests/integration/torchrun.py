"""Run a worker module under ``torchrun`` (``python -m torch.distributed.run``) the way a cluster job does: one
node agent, a c10d rendezvous on 127.0.0.1 with a free port, and ``--max-restarts`` so a failed worker group is
restarted by torchrun itself (auto-resume is then up to the library)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.launch import REPO, free_port


@dataclasses.dataclass
class TorchrunResult:
    returncode: int
    output: str  # the agent's and every worker's stdout/stderr, interleaved
    seconds: float


def torchrun(
    module: str,
    *args: str,
    nprocs: int = 2,
    nnodes: int = 1,
    max_restarts: int = 1,
    timeout: float = 300,
    env: dict | None = None,
) -> TorchrunResult:
    """``torchrun --max-restarts=max_restarts -m module args`` on ``nnodes`` agents of ``nprocs`` local workers each
    (several agents on this machine stand for several nodes). A run still going after ``timeout`` seconds is a
    hang: every process of it dumps its Python stacks into the output (workers that call
    ``faulthandler.register(SIGUSR1)``) and is killed; the result then has returncode -9."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node),
            "--nproc-per-node",
            str(nprocs),
            "--max-restarts",
            str(max_restarts),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--monitor-interval",
            "0.1",
            "-m",
            module,
            *args,
        ]
        for node in range(nnodes)
    ]
    # torch's default agent store, shared by every attempt, as a user's torchrun has it: ZeroStrategy must not
    # read an earlier attempt's keys there (lightning_zero/strategy/attempt_store.py).
    run_env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    run_env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {})
    )
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: workers torchrun leaves behind cannot block us
        agents = [subprocess.Popen(c, cwd=REPO, env=run_env, stdout=log, stderr=subprocess.STDOUT) for c in commands]
        returncode = 0
        for agent in agents:
            try:
                returncode = agent.wait(timeout=max(0.0, timeout - (time.monotonic() - started))) or returncode
            except subprocess.TimeoutExpired:
                for other in agents:
                    _kill_tree(other.pid)
                    other.wait()
                returncode = -9
                print(f"\n[torchrun helper] killed after {timeout} s (a hang)", file=log)
                break
        log.flush()
        log.seek(0)
        return TorchrunResult(returncode, log.read(), time.monotonic() - started)


def _kill_tree(root: int) -> None:
    """SIGUSR1 (stack dump), then SIGKILL, to ``root`` and every descendant (torchrun starts its workers in
    sessions of their own, so a process-group kill would miss them)."""
    tree = [root, *_descendants(root)]
    for signum, pause in ((signal.SIGUSR1, 2.0), (signal.SIGKILL, 0.0)):
        for pid in tree[1:] if signum == signal.SIGUSR1 else tree:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        time.sleep(pause)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found
