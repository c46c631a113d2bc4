"""Rank processes forked from one that has imported torch, Lightning and transformers already.

A new Python process spends about 10 s of CPU importing torch, Lightning (which imports torchmetrics, which imports
transformers) and this package, before a rank program does anything; on 2 cores that was most of the test suite's
time. The server (``python -m tests.forkserver``) pays it once per session, then forks a child for each process the
tests start, as ``multiprocessing``'s forkserver does. A child behaves as ``python -m MODULE ARGS`` would, with its
own environment, working directory and standard streams (descriptors sent over a Unix socket), and exits with the
code that process would have had.

The server forks from a single thread that has run no torch operation, so no thread pool or lock is copied half-way.
The commands the tests run as a user runs them (``python -m lightning_zero fit``, the examples, torchrun) are started
as real processes, not from here.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: What every rank program imports; loaded once in the server. Not the test modules: several read their rank and
#: world size from the environment when imported, which the server's is not.
PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning",
    "lightning.pytorch",
    "transformers",
    "lightning_zero",
    "lightning_zero.strategy.zero_strategy",
    "lightning_zero.cli.train",
)
_MAX_HEADER = 1 << 20


# ---------------------------------------------------------------------------------------------- client side
class ForkedProcess:
    """The part of ``subprocess.Popen``'s interface the test harness uses, for a child of the server."""

    def __init__(self, pid: int, connection: socket.socket, pending: bytes) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._connection = connection
        self._pending = pending  # what the server sent after the pid: the exit code, if the child was that quick
        if pending:
            self._read_exit()

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            self._read_exit()
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, number)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_exit(self) -> None:
        text = (self._pending or self._connection.recv(64)).decode().strip()
        self.returncode = int(text) if text else -signal.SIGKILL  # the server went away: as if killed
        self._connection.close()


class _Server:
    def __init__(self) -> None:
        self.folder = folder = Path(tempfile.mkdtemp(prefix="lz-forkserver-"))
        self.path = folder / "socket"
        ready_read, ready_write = os.pipe()
        repo = Path(__file__).resolve().parents[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
        with open(folder / "server.log", "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.forkserver", str(self.path), str(ready_write)],
                cwd=repo,
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(ready_write,),
            )
        os.close(ready_write)
        with os.fdopen(ready_read) as ready:
            if ready.read() != "ready":
                raise RuntimeError(f"the fork server did not start; see {folder / 'server.log'}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # its lifeline: the server ends its children and itself
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_SERVER: _Server | None = None
_LOCK = threading.Lock()


def start(
    module: str, args: list[str], *, env: dict, cwd: Path, stdout: int, fds: dict[int, int] | None = None
) -> ForkedProcess:
    """Fork ``python -m module args``: ``stdout`` (a descriptor) takes its stdout and stderr, ``fds`` maps more
    descriptor numbers of the child to descriptors of this process (its stdin is /dev/null unless ``fds`` gives 0)."""
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER.process.poll() is not None:
            if _SERVER is None:  # a launch outside pytest (no session fixture to close it) cleans up at exit too
                atexit.register(close)
            else:  # the server went away: its folder goes with it
                _SERVER.close()
            _SERVER = _Server()
        path = _SERVER.path
    mapping = {1: stdout, 2: stdout, **(fds or {})}
    targets = sorted(mapping)
    header = json.dumps({"module": module, "args": list(args), "env": env, "cwd": str(cwd), "fds": targets})
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(str(path))
    socket.send_fds(connection, [header.encode()], [mapping[t] for t in targets])
    received = b""
    while b"\n" not in received:
        chunk = connection.recv(64)
        if not chunk:
            connection.close()
            raise RuntimeError(f"the fork server could not start {module}")
        received += chunk
    pid, pending = received.split(b"\n", 1)
    return ForkedProcess(int(pid), connection, pending)


def close() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.close()
        _SERVER = None


# ---------------------------------------------------------------------------------------------- server side
def _child(request: dict, fds: list[int], sockets: list[socket.socket], server_fds: list[int]) -> None:
    """In the forked child: become ``python -m module args``; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for each in sockets:
        each.close()
    for fd in server_fds:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for target, fd in zip(request["fds"], fds):
        os.dup2(fd, target)
    for fd in {*fds, devnull} - set(request["fds"]):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    code = 0
    try:
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a process
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def serve(path: str, ready_fd: int) -> None:
    for name in PRELOAD:
        __import__(name)
    assert threading.active_count() == 1, "the server forks from its only thread"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    os.write(ready_fd, b"ready")
    os.close(ready_fd)
    while True:
        ready, _, _ = select.select([listener, wakeup_read, sys.stdin], [], [])
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):  # the test session ended
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        if wakeup_read in ready:
            os.read(wakeup_read, 4096)
            _reap(children)
        if listener in ready:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, _MAX_HEADER, 64)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                _child(request, fds, [listener, connection, *children.values()], [wakeup_read, wakeup_write])
            for fd in fds:
                os.close(fd)
            children[pid] = connection
            connection.sendall(f"{pid}\n".encode())
            _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the test that started it is gone
            connection.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
