"""The watchdog's decisions and messages, without processes: records in, a diagnosis (or none) out."""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_zero.engine.comm.flight import FlightRecorder, Op
from lightning_zero.faults import failures
from lightning_zero.faults.activity import Activity, category, classify
from lightning_zero.faults.diagnosis import decide, exit_agreement, explain
from lightning_zero.faults.diagnosis_types import Context, Limits
from lightning_zero.faults.divergence import compare_marks
from lightning_zero.faults.heartbeat import (
    FAILED,
    FINISHED,
    Peer,
    Record,
    disk_io,
    liveness,
    scheduled_seconds,
    this_process,
    thread_schedules,
)
from lightning_zero.faults.watchdog import paused_for
from tests.unit.diagnosis_records import CONTEXT, LIMITS, computing, marks, peer, record, waiting


def test_limits_follow_the_timeout():
    short, default = Limits.for_timeout(8), Limits.for_timeout(60)
    assert short.pg_timeout > short.timeout and default.pg_timeout > default.timeout  # the diagnosis comes first
    assert short.stale_after < short.timeout and default.stale_after == 15
    assert default.abort_grace < 30 and default.sigterm_grace <= 25
    assert short.extended(600).timeout == 600 and short.extended(600).stale_after == 600


def test_a_healthy_or_merely_slow_peer_is_not_a_hang():
    me = record(0, waiting(blocked_for=LIMITS.timeout - 1))
    slow = record(1, computing())  # 10x slower, still computing, heartbeat fresh
    assert decide(me, {1: peer(slow)}, None, LIMITS, CONTEXT) is None
    assert decide(record(0), {1: peer(slow, age=60)}, None, LIMITS, CONTEXT) is None  # nobody waits on it


def test_the_first_failure_is_every_ranks_error():
    failure = {
        "rank": 1,
        "culprit": 1,
        "kind": "error",
        "message": "rank 1 raised ValueError: boom (in training batch 2)",
    }
    found = decide(record(0, waiting()), {}, failure, LIMITS, CONTEXT)
    assert found.culprit == 1 and "ValueError: boom" in found.summary
    assert "This rank (0) was in training batch 2, waiting in reduce_scatter #16 (world op 39)" in found.summary


def test_a_failed_or_vanished_peer_is_named_with_where_it_was():
    failed = record(1, waiting("all_gather", 17, 40), state=FAILED, error="OSError: disk")
    found = decide(record(0, waiting()), {1: peer(failed)}, None, LIMITS, CONTEXT)
    assert found.kind == "failed" and found.culprit == 1 and "OSError: disk" in found.summary
    gone = record(1, waiting("all_gather", 17, 40, site="model.py:8 in forward"))
    found = decide(record(0, waiting()), {1: peer(gone, liveness="dead")}, None, LIMITS, CONTEXT)
    assert found.kind == "died" and "rank 1's process ended" in found.summary
    assert "all_gather #17 (world op 40)" in found.summary and "model.py:8 in forward" in found.summary


def test_a_silent_peer_is_stale_only_while_someone_waits_for_it():
    quiet = record(1, computing())
    me = record(0, waiting(blocked_for=5))
    assert decide(me, {1: peer(quiet, age=LIMITS.stale_after - 0.5)}, None, LIMITS, CONTEXT) is None
    found = decide(me, {1: peer(quiet, age=LIMITS.stale_after + 1, liveness="stopped")}, None, LIMITS, CONTEXT)
    assert found.kind == "stale" and found.culprit == 1
    assert "no heartbeat for 5 s" in found.summary and "SIGSTOP" in found.summary
    assert "This rank (0) is in training batch 2, waiting in reduce_scatter #16" in found.summary
    assert "timeout=" in found.hint


def test_under_nccl_a_rank_without_progress_counts_as_waiting():
    """NCCL does not block the CPU inside the collective: no progress for as long as a heartbeat is missing."""
    quiet = record(1, computing())
    me = record(0, computing(site="train.py:9 in training_step"))
    assert decide(me, {1: peer(quiet, age=LIMITS.stale_after + 1)}, None, LIMITS, CONTEXT) is None
    me.stalled = LIMITS.stale_after
    assert decide(me, {1: peer(quiet, age=LIMITS.stale_after + 1)}, None, LIMITS, CONTEXT).kind == "stale"


def test_an_unreachable_store_is_named():
    found = decide(record(1, waiting(blocked_for=6)), {}, None, LIMITS, CONTEXT, store_silent=LIMITS.stale_after + 1)
    assert found.kind == "store" and "rank 0" in found.summary


def test_uneven_data_a_peer_that_finished_while_this_rank_waits():
    done = record(0, Activity(seq=60), state=FINISHED, steps={"train": 4})
    me = record(1, waiting(blocked_for=0.5, seq=61), batch=4)
    # symmetric ranks: this rank issued an operation beyond the finished rank's last one: certain at once
    found = decide(me, {0: peer(done)}, None, LIMITS, CONTEXT)
    assert found.kind == "finished" and found.culprit == 0
    assert "rank 0 finished (4 training batches" in found.summary and "reduce_scatter #16" in found.summary
    assert "use_distributed_sampler" in found.hint
    # under pipeline stages only a wait that lasts tells
    assert decide(me, {0: peer(done)}, None, LIMITS, Context(2, symmetric=False)) is None
    me.activity.blocked_for = LIMITS.settle
    assert decide(me, {0: peer(done)}, None, LIMITS, Context(2, symmetric=False)).kind == "finished"


def test_a_rank_that_joined_this_ranks_collective_and_finished_is_not_early():
    """Seen on the loaded 2-core machine: rank 1 went through the broadcast rank 0 waited in, finished the run, and
    rank 0's main thread had not been scheduled for 4 s. The world group's sequence numbers show the peer joined."""
    done = record(1, Activity(seq=36862), state=FINISHED, phase="val", steps={"val": 2})
    me = record(0, waiting(kind="broadcast", op=None, seq=36851, blocked_for=LIMITS.settle + 2), phase=None)
    assert decide(me, {1: peer(done)}, None, LIMITS, CONTEXT) is None
    # the same wait in a subgroup's operation after the peer's last world operation still ends the run
    done.seq = me.activity.seq
    assert decide(me, {1: peer(done)}, None, LIMITS, CONTEXT).kind == "finished"


def test_a_rank_that_issued_this_ranks_collective_and_finished_is_not_early():
    """Seen under coverage: rank 1 finished with 18 collectives while rank 0's sample still showed it in
    reduce_scatter #16 (world op 169, rank 1's last world op too). The collective numbers show the peer joined."""
    done = record(1, Activity(seq=169), state=FINISHED, ops=18, steps={"train": 3})
    me = record(0, waiting(op=16, seq=169, blocked_for=LIMITS.settle + 2))
    assert decide(me, {1: peer(done)}, None, LIMITS, CONTEXT) is None
    done.ops = 15  # the peer never issued #16: it never joins, however short the wait
    me.activity.blocked_for = 0.1
    assert decide(me, {1: peer(done)}, None, LIMITS, CONTEXT).kind == "finished"


def test_silent_divergence_the_first_differing_step_and_collective():
    common = [Op(14, "all_gather", 247, "float32"), Op(15, "reduce_scatter", 494, "float32")]
    a = record(
        0,
        marks=marks(("train", 1, 12, 111, 30), ("train", 2, 15, 222, 38), ("train", 3, 19, 333, 48)),
        recent=common + [Op(16, "all_reduce", 1, "float32"), Op(17, "reduce_scatter", 494, "float32")],
    )
    b = record(
        1,
        marks=marks(("train", 1, 12, 111, 30), ("train", 2, 15, 222, 38), ("train", 3, 18, 444, 47)),
        recent=common + [Op(16, "reduce_scatter", 494, "float32")],
    )
    assert compare_marks(a, a, CONTEXT) is None
    found = compare_marks(a, b, CONTEXT)
    assert found.kind == "diverged" and found.culprit == 1
    assert "during training batch 2 (before training batch 3 began)" in found.summary
    assert "4 collectives on rank 0, 3 on rank 1" in found.summary
    assert "#16: all_reduce #16 (1 x float32) vs reduce_scatter #16 (494 x float32)" in found.summary
    assert found == decide(a, {1: peer(b)}, None, LIMITS, CONTEXT, mark_peer=1)


def test_as_many_but_different_collectives_blame_no_rank_for_issuing_fewer():
    """Each rank took its own branch (an expert unit gathered on one rank, another on the other): the same count,
    different collectives, and neither is behind the other."""
    common = [Op(14, "all_gather", 247, "float32")]
    a = record(
        0,
        marks=marks(("train", 1, 12, 111, 30), ("train", 2, 14, 222, 38)),
        recent=common + [Op(15, "all_gather", 96, "float32", unit="experts.0"), Op(16, "all_reduce", 1, "float32")],
    )
    b = record(
        1,
        marks=marks(("train", 1, 12, 111, 30), ("train", 2, 14, 333, 38)),
        recent=common + [Op(15, "all_gather", 96, "float32", unit="experts.1"), Op(16, "all_reduce", 1, "float32")],
    )
    found = compare_marks(a, b, CONTEXT)
    assert found.kind == "diverged" and found.culprit is None
    assert (
        "2 collectives on rank 0, 2 on rank 1" in found.summary
        and "#15: all_gather #15 (96 x float32, experts.0)" in found.summary
    )
    assert "(it issued fewer)" not in found.summary and "Neither issued fewer" in found.summary


def test_divergence_outside_our_collectives_is_seen_in_the_sequence_number():
    a = record(0, marks=marks(("val", 0, 5, 9, 20), ("val", 1, 5, 9, 26)))
    b = record(1, marks=marks(("val", 0, 5, 9, 20), ("val", 1, 5, 9, 23)))
    found = compare_marks(a, b, CONTEXT)
    assert "torch.distributed operations" in found.summary and "world op 26 on rank 0, 23 on rank 1" in found.summary
    assert compare_marks(a, b, Context(2, symmetric=False)) is None  # pipeline ranks differ by role


def test_stuck_names_the_rank_in_another_collective_or_in_none():
    me = record(0, waiting("all_reduce", 16, 38, blocked_for=9, site="model.py:40 in training_step"))
    other = record(1, waiting("reduce_scatter", 16, 39, blocked_for=8))
    found = decide(me, {1: peer(other)}, None, LIMITS, CONTEXT)
    assert found.kind == "diverged" and found.culprit == 1
    assert "all_reduce #16 (world op 38), called from model.py:40 in training_step" in found.summary
    assert "rank 1 is in a different collective: in training batch 2, waiting in reduce_scatter #16" in found.summary
    away = record(1, computing(site="eval.py:3 in on_validation_epoch_end"))
    found = decide(me, {1: peer(away)}, None, LIMITS, CONTEXT)
    assert found.kind == "stuck" and "did not join it" in found.summary and "eval.py:3" in found.summary
    assert "extended" in found.hint


def test_hugging_face_generate_gets_the_synced_gpus_hint():
    gen = "generation/utils.py:3235 in _sample"
    me = record(1, waiting("all_gather", 13, 134, blocked_for=4, via=gen), phase="val", batch=0)
    done = record(0, Activity(seq=120), state=FINISHED, phase="val", steps={"val": 2})
    found = decide(me, {0: peer(done)}, None, LIMITS, CONTEXT)
    assert "synced_gpus=True" in found.hint
    # without a sample inside generate(): the strategy's hint that the model can generate, in evaluation
    me.activity.via = None
    assert "synced_gpus=True" in decide(me, {0: peer(done)}, None, LIMITS, Context(2, generate_hint=True)).hint
    assert "synced_gpus" not in decide(me, {0: peer(done)}, None, LIMITS, CONTEXT).hint


def test_exit_agreement():
    me = record(1, Activity(seq=50), state=FINISHED)
    finished = record(0, Activity(seq=50), state=FINISHED)
    assert exit_agreement(me, {0: peer(finished)}, None, LIMITS, CONTEXT, 0.1) is True
    computing_peer = record(0, computing())
    assert exit_agreement(me, {0: peer(computing_peer)}, None, LIMITS, CONTEXT, 1.0) is None  # keep waiting
    late = exit_agreement(me, {0: peer(computing_peer)}, None, LIMITS, CONTEXT, LIMITS.timeout)
    assert late.kind == "stuck" and "did not finish within timeout=8 s" in late.summary
    blocked = record(0, waiting(blocked_for=LIMITS.settle))
    found = exit_agreement(me, {0: peer(blocked)}, None, LIMITS, CONTEXT, 1.0)
    assert found.kind == "finished" and found.culprit == 1 and "rank 0 still runs" in found.summary
    # Seen under load: this rank issued the collective the peer still seems to wait in (its main thread was not
    # scheduled since), so the peer will finish too.
    me.ops = 18
    assert exit_agreement(me, {0: peer(blocked)}, None, LIMITS, CONTEXT, 1.0) is None


def test_a_silent_peer_whose_process_runs_or_waits_for_a_core_is_busy_not_stale():
    """On a loaded machine a healthy peer's watchdog can wait seconds for a core: its heartbeat is late, but the
    kernel counts its process as running or runnable meanwhile. Only a silent process that did not run (stopped,
    hung asleep in native code) is stale; the collective's timeout still bounds the wait for a busy one."""
    me = record(0, waiting(blocked_for=5))
    silent = record(1, computing())
    age = LIMITS.stale_after + 1
    assert decide(me, {1: Peer(silent, age, "alive", ran=age * 0.9)}, None, LIMITS, CONTEXT) is None
    found = decide(me, {1: Peer(silent, age, "alive", ran=0.1)}, None, LIMITS, CONTEXT)
    assert found.kind == "stale" and found.culprit == 1
    assert (
        decide(me, {1: Peer(silent, age, "unknown", ran=None)}, None, LIMITS, CONTEXT).kind == "stale"
    )  # another host
    finished = record(0, waiting(blocked_for=1))
    assert exit_agreement(finished, {1: Peer(silent, age, "alive", ran=age)}, None, LIMITS, CONTEXT, 1.0) is None


def test_scheduled_seconds_tell_a_stopped_process_from_one_waiting_for_a_core():
    """The evidence behind a pause: a busy process beside two other busy loops on the same core (on any machine,
    more runnable threads than cores) is charged the whole time, running or waiting in the run queue; the same
    process stopped by SIGSTOP is charged nothing."""
    loop = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    core = min(os.sched_getaffinity(0))
    processes = [
        subprocess.Popen([sys.executable, "-c", loop], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        for _ in range(3)
    ]
    try:
        child = processes[0]
        window = 1.0

        def waited() -> float:  # nanoseconds in the run queue, the second field of schedstat
            with open(f"/proc/{child.pid}/schedstat") as f:
                return int(f.read().split()[1])

        def charged() -> float:
            before, start = scheduled_seconds(child.pid), time.monotonic()
            time.sleep(window)
            return (scheduled_seconds(child.pid) - before) / (time.monotonic() - start)

        assert scheduled_seconds(child.pid) is not None
        before, start = waited(), time.monotonic()
        assert charged() >= 0.8  # loaded: on the core or waiting for it
        assert (waited() - before) / 1e9 >= 0.3 * (time.monotonic() - start)  # a third of the core each: it waited
        os.kill(child.pid, signal.SIGSTOP)
        assert charged() <= 0.05
        os.kill(child.pid, signal.SIGCONT)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert scheduled_seconds(child.pid) is None  # gone


def test_a_sleeping_threads_schedule_is_its_own_not_its_busy_processs():
    """[Note: a pause, not a busy machine] reads the watchdog thread alone: while another thread of the same process
    works (or waits for a core), a thread asleep in ``select`` is charged next to nothing, as it would be over a
    SIGSTOP, where the whole process is charged the other threads' time."""
    started, stop = threading.Event(), threading.Event()
    sleeper: list[int] = []

    def sleep() -> None:
        sleeper.append(threading.get_native_id())
        started.set()
        stop.wait()

    thread = threading.Thread(target=sleep)
    thread.start()
    try:
        started.wait()
        thread_before, process_before = scheduled_seconds(task=sleeper[0]), scheduled_seconds()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # this thread works meanwhile
            pass
        thread_after, process_after = scheduled_seconds(task=sleeper[0]), scheduled_seconds()
    finally:
        stop.set()
        thread.join()
    assert None not in (thread_before, process_before, thread_after, process_after)
    assert process_after - process_before >= 0.4  # the worker: on a core or waiting for one, the whole time
    assert thread_after - thread_before <= 0.05  # the sleeper: neither


def test_a_watchdog_kept_from_the_interpreter_lock_is_not_a_paused_process():
    """A long call that holds the interpreter's lock (``compile()``, as an import without its ``.pyc`` runs) leaves
    the watchdog thread waiting for the lock asleep, as little scheduled as under SIGSTOP; the thread holding it ran
    meanwhile, so no pause is claimed. A thread that only sleeps is still a pause for the same schedules."""
    ticks, started, stop = [], threading.Event(), threading.Event()

    def watch():
        own = threading.get_native_id()
        before, start = thread_schedules(), time.monotonic()
        started.set()
        stop.wait()  # woken while the main thread still holds the lock: it runs again when the compile returns
        ticks.append((own, before, thread_schedules(), time.monotonic() - start))

    watcher = threading.Thread(target=watch)
    watcher.start()
    started.wait()
    time.sleep(0.05)
    source = "\n".join(f"x{i} = ({i} + {i}) * {i}" for i in range(60_000))
    stop.set()
    compile(source, "big", "exec")
    watcher.join()
    own, before, after, gap = ticks[0]
    limits = dataclasses.replace(LIMITS, stale_after=min(0.2, gap / 2))
    assert after[own] - before[own] < gap / 2  # the watchdog's own schedule alone reads a pause
    assert paused_for(gap, before, after, own, limits) == 0.0
    assert paused_for(gap, {own: before[own]}, {own: after[own]}, own, limits) == gap  # a sleeper, alone


def test_a_read_from_the_disk_shows_in_the_disk_io():
    """Reading a file out of the page cache (the page cache of CI machines here keeps little) counts in the disk reads
    that keep a silent peer still reading from the disk from being judged stale."""
    before = disk_io()
    path = f"/tmp/lz-disk-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: the read goes to the disk
        os.read(fd, 1 << 20)
        os.close(fd)
    finally:
        os.unlink(path)
    after = disk_io()
    assert before is not None and after is not None and after != before


def test_a_rank_that_was_paused_says_so():
    me = record(1, computing(), paused=12.0)
    found = explain(me, {}, LIMITS, CONTEXT, "Connection closed by peer")
    assert found.culprit == 1 and "could not run for 12 s" in found.summary


def test_explain_a_communication_error_with_what_the_peers_do():
    me = record(0, waiting())
    found = explain(
        me,
        {1: peer(record(1, computing(site="x.py:1 in f")), age=2)},
        LIMITS,
        CONTEXT,
        "[pair.cc:553] Connection closed by peer\nmore",
    )
    assert "Connection closed by peer" in found.summary and "more" not in found.summary
    seen = "rank 1 was last seen (2 s ago) in training batch 2, not in a collective, called from x.py:1 in f"
    assert seen in found.summary


def test_records_round_trip():
    rec = record(
        3,
        waiting(),
        marks=marks(("train", 0, 1, 2, 3)),
        recent=[Op(1, "all_gather", 4, "bfloat16")],
        steps={"train": 1},
        proc=this_process(),
        signal="SIGTERM",
    )
    assert Record.decode(rec.encode()) == rec


def test_liveness_of_processes():
    assert liveness(this_process()) == "alive"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    host, namespace, _, start = this_process().split("|")
    assert liveness(f"{host}|{namespace}|{child.pid}|{start}") == "dead"
    assert liveness(f"another-host|{namespace}|{os.getpid()}|{start}") == "unknown"


def test_activity_finds_the_collective_and_the_users_call_site():
    import lightning
    import transformers

    torch_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    frames = [
        (torch_file, 3252, "all_reduce"),
        (os.path.join(os.path.dirname(lightning.__file__), "pytorch", "loops", "loop.py"), 10, "run"),
        (os.path.join(os.path.dirname(transformers.__file__), "generation", "utils.py"), 3235, "_sample"),
        ("/home/me/project/train.py", 42, "validation_step"),
    ]
    sample = classify(frames, FlightRecorder(), seq=7)
    assert sample.in_collective and sample.kind == "all_reduce" and sample.op is None and sample.seq == 7
    assert sample.site == "project/train.py:42 in validation_step"
    assert sample.via == "generation/utils.py:3235 in _sample"
    assert category(lightning.__file__) == "framework" and category(failures.__file__) == "ours"


def test_flight_recorder_digest_and_threads():
    a, b = FlightRecorder(), FlightRecorder()
    for rec in (a, b):
        rec.reset(None)
        rec.enabled = True
        rec.issue("all_gather", 247, torch.float32)
        rec.mark("train", 0)
    assert a.marks[-1] == b.marks[-1]
    b.issue("all_reduce", 1, torch.float32)
    other = threading.Thread(target=a.issue, args=("all_reduce", 1, torch.float32))  # a background writer
    other.start()
    other.join()
    a.mark("train", 1)
    b.mark("train", 1)
    assert a.marks[-1].ops == 1 and b.marks[-1].ops == 2 and a.marks[-1].digest != b.marks[-1].digest
    assert [op.describe() for op in b.recent_ops()] == ["all_gather #1 (247 x float32)", "all_reduce #2 (1 x float32)"]


def test_the_same_error_on_every_rank_needs_no_note():
    error = TypeError("LBFGS is not elementwise")
    first = {"rank": 0, "kind": "error", "error": failures.error_text(error), "message": "rank 0 raised ..."}
    failures.brought_down_by(error, first, rank=1)
    assert "first failure" not in str(error)
    other = ValueError("consequence")
    failures.brought_down_by(other, first, rank=1)
    assert "the run was brought down by the first failure: rank 0 raised" in str(other)


@pytest.mark.parametrize("value", [0, -3, "60", True])
def test_timeout_must_be_positive_seconds_or_a_timedelta(value):
    from lightning_zero.config.choices import ZeroConfigError
    from lightning_zero.config.zero_config import ZeroConfig

    with pytest.raises(ZeroConfigError, match="`timeout` must be a positive"):
        ZeroConfig(timeout=value)
