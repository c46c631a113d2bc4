"""The flight file a rank leaves behind (see [Note: the flight file]): what a peer on the same host reads back after
the rank died in native code, was killed, or parted from the others in another stage-3 unit."""

import os

import torch

import lightning_zero
from lightning_zero.engine.comm.flight import FlightRecorder, Op
from lightning_zero.faults.diagnosis import decide
from tests.unit.diagnosis_records import CONTEXT, LIMITS, peer, record, waiting


def _recording(path, process: str) -> FlightRecorder:
    """A flight recorder of this process writing its memory-mapped copy to ``path``, as a rank's does."""
    recorder = FlightRecorder()
    recorder.reset(None)
    recorder.enabled = True
    recorder.write_to(path, process)
    return recorder


def test_a_rank_that_died_in_native_code_is_read_back_from_its_flight_file_and_stack(tmp_path):
    """What a peer on the same host reads after gloo aborted a rank (see [Note: the flight file]): the collectives
    as the recorder wrote them up to the crash, the step, the signal and the user's call site from the main
    thread's stack in faulthandler's dump."""
    from lightning_zero.faults.diagnosis import crashed
    from lightning_zero.faults.postmortem import read_record

    recorder = _recording(tmp_path / "rank1.flight", "somehost|1|999999|1")
    for _ in range(40):  # more than the ring holds
        recorder.issue("all_gather", 2624, torch.float32)
    recorder.mark("val", 0)
    number = recorder.issue("all_gather", 1056, torch.float32)
    recorder.wait(number, "all_gather")
    main = f"0x{recorder.main:016x}"
    (tmp_path / "rank1.fatal").write_text(
        "Fatal Python error: Aborted\n\nThread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n\n'
        f"Thread {main} (most recent call first):\n"
        f'  File "{os.path.dirname(torch.__file__)}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 449 in x\n'
        '  File "/home/me/project/train.py", line 16 in validation_step\n'
        '  File "/home/me/project/train.py", line 27 in <module>\n'
    )
    dead = read_record(tmp_path, 1)
    recorder.close_file()
    assert dead.ops == 41 and [op.number for op in dead.recent] == list(range(10, 42))
    assert dead.recent[-1] == Op(41, "all_gather", 1056, "float32")
    assert dead.phase == "val" and dead.batch == 0 and dead.steps == {"val": 1}
    assert (
        dead.activity.in_collective
        and dead.activity.op == 41
        and dead.activity.site == "project/train.py:16 in validation_step"
    )
    assert dead.crash.startswith("SIGABRT; its Python stack is in ") and dead.crash.endswith("rank1.fatal")
    me = record(
        0,
        waiting(kind="all_gather", op=41),
        phase="val",
        batch=1,
        recent=[Op(n, "all_gather", 2624, "float32") for n in range(30, 42)],
        ops=41,
    )
    found = decide(me, {1: peer(dead, liveness="dead")}, None, LIMITS, CONTEXT)
    assert found == crashed(dead, me) and found.culprit == 1
    assert found.summary.startswith("rank 1's process crashed in native code (SIGABRT; its Python stack is in ")
    assert (
        "in validation batch 0, in all_gather #41 (1056 x float32), called from project/train.py:16 in "
        "validation_step. gloo aborts a process whose collective does not match its peer's"
    ) in found.summary
    assert (
        "the first that differs is #41: all_gather #41 (1056 x float32) on rank 1 vs all_gather #41 (2624 x "
        "float32) on rank 0"
    ) in found.summary
    assert "Every rank must issue the same collectives in the same order" in found.hint


def test_a_rank_gloo_aborted_after_its_collective_returned_still_gets_the_mismatch_hint():
    """gloo may abort a rank in its background thread after the mismatched all_gather returned to Python: its black
    box says it was not in a collective, and the differing records are what tell the mismatch (seen under CI)."""
    from lightning_zero.faults.activity import Activity
    from lightning_zero.faults.diagnosis import crashed

    after = Activity(False, None, None, 80, 0.0, "project/train.py:16 in validation_step", None, "all_gather #41")
    dead = record(
        1,
        after,
        phase="val",
        batch=0,
        recent=[Op(41, "all_gather", 1056, "float32")],
        ops=41,
        crash="SIGABRT; its Python stack is in /tmp/rank1.fatal",
    )
    me = record(
        0,
        waiting(kind="all_gather", op=41),
        phase="val",
        batch=0,
        recent=[Op(41, "all_gather", 2624, "float32")],
        ops=41,
    )
    found = crashed(dead, me)
    assert "not in a collective (the last it issued: all_gather #41)" in found.summary
    assert "gloo aborts a process whose collective does not match its peer's" in found.summary
    assert "the first that differs is #41" in found.summary
    assert "Every rank must issue the same collectives in the same order" in found.hint
    same = record(0, waiting(kind="all_gather", op=42), recent=[Op(41, "all_gather", 1056, "float32")], ops=41)
    assert crashed(dead, same).hint == ""  # the same collectives: a crash of another kind, no mismatch said


def test_a_rank_that_died_posting_its_collective_is_read_back_in_it(tmp_path):
    """gloo may abort a rank while its main thread still posts the ring's transfers, before the recorder marks the
    wait: the stack inside the communication layer says it was in its last collective."""
    from lightning_zero.faults.postmortem import read_record

    recorder = _recording(tmp_path / "rank0.flight", "somehost|0|999999|1")
    recorder.mark("val", 0)
    recorder.issue("all_gather", 1056, torch.float32)
    main = f"0x{recorder.main:016x}"
    comm = os.path.join(os.path.dirname(lightning_zero.__file__), "engine", "comm")
    (tmp_path / "rank0.fatal").write_text(
        f"Fatal Python error: Aborted\n\nThread {main} (most recent call first):\n"
        f'  File "{comm}/p2p_transport.py", line 90 in __init__\n'
        f'  File "{comm}/collectives.py", line 120 in all_gather\n'
        '  File "/home/me/project/train.py", line 16 in validation_step\n'
    )
    dead = read_record(tmp_path, 0)
    recorder.close_file()
    assert dead.activity.in_collective and dead.activity.op == 1 and dead.activity.kind == "all_gather"
    assert dead.activity.site == "project/train.py:16 in validation_step"


def test_a_rank_killed_without_a_stack_is_still_reported_from_its_flight_file(tmp_path):
    from lightning_zero.faults.postmortem import read_record

    recorder = _recording(tmp_path / "rank1.flight", "h|1|2|3")
    recorder.mark("train", 3)
    recorder.issue("reduce_scatter", 10, torch.bfloat16)
    dead = read_record(tmp_path, 1)
    recorder.close_file()
    assert not (tmp_path / "rank1.flight").exists()  # a clean stop leaves nothing behind
    assert dead.crash is None and dead.phase == "train" and dead.batch == 3 and not dead.activity.in_collective
    assert dead.activity.last == "reduce_scatter #1" and dead.recent == [Op(1, "reduce_scatter", 10, "bfloat16")]
    found = decide(record(0, waiting()), {1: peer(dead, liveness="dead")}, None, LIMITS, CONTEXT)
    assert found.kind == "died" and "last seen in training batch 3" in found.summary


def test_a_collective_of_pickled_objects_reads_back_from_the_flight_file_as_it_was_recorded(tmp_path):
    """A peer compares its own ring with one read from a dead rank's flight file: the dtype-less collectives
    (``broadcast_object``) must read alike in both, or the first difference named is one that never was."""
    from lightning_zero.engine.comm.flight import read_file

    recorder = _recording(tmp_path / "rank1.flight", "somehost|1|999999|1")
    recorder.issue("broadcast_object", 0, None)
    recorder.issue("all_gather", 1056, torch.float32)
    snapshot = read_file(tmp_path / "rank1.flight")
    recorder.close_file()
    assert [Op(*op) for op in snapshot.recent] == recorder.recent_ops()
    assert recorder.recent_ops()[0] == Op(1, "broadcast_object", 0, "?")


def test_collectives_of_different_stage_3_units_part_the_digests_and_are_named(tmp_path):
    """Two ranks gathering different units of one size (experts each a unit): the same kinds and sizes, but the
    running hash parts at the collective, whose description names each rank's unit, also as read from the file."""
    from lightning_zero.engine.comm.flight import read_file, unit_code
    from lightning_zero.faults.divergence import first_difference

    a, b = _recording(tmp_path / "rank0.flight", "somehost|1|1|1"), FlightRecorder()
    b.reset(None)
    b.enabled = True
    for recorder, expert in ((a, "blocks.0.experts.0"), (b, "blocks.0.experts.1")):
        recorder.issue("all_gather", 72, torch.float32, unit_code("blocks.0"))
        recorder.issue("all_gather", 72, torch.float32, unit_code(expert))
    snapshot = read_file(tmp_path / "rank0.flight")
    a.close_file()
    assert a.digest != b.digest
    assert [Op(*op) for op in snapshot.recent] == a.recent_ops()
    assert first_difference(a.recent_ops(), b.recent_ops(), 1, ranks=(0, 1)) == (
        "#2: all_gather #2 (72 x float32, blocks.0.experts.0) on rank 0 vs all_gather #2 (72 x float32, "
        "blocks.0.experts.1) on rank 1"
    )
