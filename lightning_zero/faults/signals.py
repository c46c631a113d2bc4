"""Seeing SIGTERM while the main thread is blocked, and a SIGTERM handler that never communicates.

A Python signal handler runs in the main thread between bytecodes, so it cannot run while that thread is
blocked inside a collective (a C call) — the case where a scheduler's SIGTERM matters most. But Python's
C-level handler writes the signal number to the *wakeup fd* (``signal.set_wakeup_fd``) at once, from any
state; the watchdog thread selects on that pipe and so learns of the signal immediately (see
``watchdog.py`` for what it then does). The wakeup fd is one per process: a previous one (asyncio sets one)
keeps receiving every byte.

The handler itself (:func:`replace_handler`) only records the signal and calls the handlers it chains; it
never starts a collective (Lightning 2.6's own SIGTERM handler calls ``dist.broadcast`` inside the
handler, which pairs with whatever collective the other ranks are in).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType

Handler = Callable[[int, FrameType | None], None]


#: The signals after which a run stops at the next batch boundary (see [Note: SIGTERM] in ``watchdog.py``).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """A stop signal that arrived, and when the process must end if the run has not stopped (see [Note: SIGTERM]
    in ``watchdog.py``)."""

    def __init__(self, number: int) -> None:
        self.at = time.monotonic()
        self.number = number
        self.name = signal.Signals(number).name

    def overdue(self, now: float, in_collective: bool, blocked_for: float, stall: float, grace: float) -> str | None:
        """Why the process must end now (waiting in one collective for ``stall`` seconds, or still running
        ``grace`` seconds after the signal), or None."""
        since = now - self.at
        if in_collective and blocked_for >= stall and since >= 1.0:
            return f"waiting in a collective for {blocked_for:.0f} s after {self.name}"
        return f"still running {since:.0f} s after {self.name}" if since >= grace else None


class WakeupPipe:
    """A pipe that receives every signal's number (and :meth:`wake`'s zero byte, used to stop the watchdog)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._previous: int | None = None

    def install(self) -> bool:
        """Route signals here (only possible from the main thread); False if it could not be done."""
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return False
        self._previous = previous if previous >= 0 and previous != self.write_fd else None
        return True

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            try:
                if signal.set_wakeup_fd(self._previous if self._previous is not None else -1) != self.write_fd:
                    # Someone replaced ours meanwhile: put theirs back.
                    signal.set_wakeup_fd(signal.set_wakeup_fd(-1))
            except (ValueError, OSError):
                pass

    def wake(self) -> None:
        try:
            os.write(self.write_fd, b"\0")
        except OSError:  # full: the reader wakes anyway
            pass

    def drain(self) -> list[int]:
        """Signal numbers received since the last call (0 for :meth:`wake`), forwarded to a previous wakeup fd."""
        out: list[int] = []
        while True:
            try:
                chunk = os.read(self.read_fd, 512)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if not chunk:
                break
            out.extend(chunk)
            if self._previous is not None:
                forward = bytes(b for b in chunk if b)
                if forward:
                    try:
                        os.write(self._previous, forward)
                    except OSError:
                        pass
        return out

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def replace_handler(signum: int, notify: Callable[[int], None], chain: Iterable[object]) -> Handler | None:
    """Install a handler for ``signum`` that calls ``notify(signum)`` and then every callable of ``chain`` (the
    handlers it replaces, minus the one it stands in for). Main thread only; returns the handler or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    chained = [h for h in chain if callable(h)]

    def handler(number: int, frame: FrameType | None) -> None:
        notify(number)
        for other in chained:
            other(number, frame)

    setattr(handler, "lightning_zero", True)  # recognised by a later install in the same run
    signal.signal(signum, handler)
    return handler


def is_ours(handler: object) -> bool:
    return bool(getattr(handler, "lightning_zero", False))
