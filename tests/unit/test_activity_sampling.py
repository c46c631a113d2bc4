"""The watchdog's sample of the main thread, taken from another thread while the main thread runs Python: the call
site and what it is inside, read from faulthandler's dump (``faults/activity.py::_frames_of``: walking the live
frames by ``f_back`` crashed CPython 3.11 now and then)."""

import threading
import time

from torch import nn

from lightning_zero.engine.comm.flight import FlightRecorder
from lightning_zero.faults.activity import main_thread_frames, sample


def build_layers() -> None:  # the user's code the samples must name
    for _ in range(50):
        nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])


def test_samples_taken_while_the_main_thread_builds_layers_name_its_call_site():
    main, recorder, samples = threading.get_ident(), FlightRecorder(), []
    building, done = threading.Event(), threading.Event()

    def watch() -> None:
        # From the first build on, until the main thread is done: on a busy machine the main thread can wait for a
        # core for tens of milliseconds inside `Thread.start`, long enough for hundreds of samples of that wait.
        building.wait()
        while not done.is_set():
            samples.append(sample(main, recorder, seq=0))

    def inside_a_build() -> bool:
        return any(s.site.endswith("in build_layers") for s in list(samples) if s.site)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        builds = 0
        building.set()
        # On a busy machine whole builds can pass between two samples (each is a dump of every thread): build until a
        # sample landed inside one, or for a minute, rather than for a fixed count.
        deadline = time.monotonic() + 60
        while (len(samples) < 200 or builds < 3 or not inside_a_build()) and time.monotonic() < deadline:
            build_layers()
            builds += 1
    finally:
        done.set()
        building.set()
        watcher.join()
    sites = [s.site for s in samples if s.site]
    assert len(sites) >= 100, len(sites)
    assert all(site.startswith("unit/test_activity_sampling.py:") for site in sites), set(sites)
    assert any(site.endswith("in build_layers") for site in sites)
    assert not any(s.in_collective for s in samples)


def test_the_main_threads_frames_are_read_from_a_dump_of_every_thread():
    dump = (
        'Thread 0x0000000000000002 (most recent call first):\n  File "/x/other.py", line 3 in wait\n\n'
        'Current thread 0x0000000000000001 (most recent call first):\n  File "/x/train.py", line 12 in step\n'
        '  File "/x/train.py", line 30 in <module>\n'
    )
    assert main_thread_frames(dump, 1) == [("/x/train.py", 12, "step"), ("/x/train.py", 30, "<module>")]
    assert main_thread_frames(dump, 2) == [("/x/other.py", 3, "wait")]
