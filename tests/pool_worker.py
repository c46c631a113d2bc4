"""One rank of a :class:`tests.pool.Pool`: runs rank programs one after another in this process, as
``python -m MODULE GROUP ...`` would, so torch, Lightning and the process group are set up once per session.

Each line on stdin is a JSON command ``{"module", "args", "env", "report", "logs"}``; the module runs as
``__main__`` with ``sys.argv`` and the environment it would have had in a process of its own, and with its stdout
and stderr in a file of its own (``logs[RANK]``), small as a fresh process's: a rank program that limits the size
of the files it may write must not fail on a log that earlier commands grew. The environment and the working
directory are restored afterwards: Lightning writes its launcher's variables (``WORLD_SIZE``, ``LOCAL_RANK``, ...)
into ``os.environ`` for the rest of a process's life. When it returns, this process writes ``ok`` (or ``failed``) to the control pipe whose descriptor
is ``argv[1]``. After a failure the process ends: a rank that failed may leave its peers inside a collective,
so the pool starts fresh ranks for the next command.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback


def output_to(path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run(command: dict) -> bool:
    output_to(command["logs"][int(os.environ["RANK"])])
    saved, cwd = dict(os.environ), os.getcwd()
    os.environ.update({**command["env"], "LZ_REPORT": command["report"]})
    sys.argv = [command["module"], *command["args"]]
    print(f"===== python -m {' '.join(sys.argv)}", flush=True)
    try:
        runpy.run_module(command["module"], run_name="__main__", alter_sys=True)
        return True
    except SystemExit as exit_:
        return exit_.code in (0, None)
    except BaseException:  # noqa: BLE001 - reported through the control pipe and the log
        traceback.print_exc()
        return False
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.chdir(cwd)
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    with os.fdopen(int(sys.argv[1]), "w", buffering=1) as control:
        for line in sys.stdin:
            ok = run(json.loads(line))
            control.write("ok\n" if ok else "failed\n")
            if not ok:
                return


if __name__ == "__main__":
    main()
