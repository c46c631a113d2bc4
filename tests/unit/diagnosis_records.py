"""Records, peers and step marks as the watchdog reads them, built by hand for the diagnosis tests."""

from lightning_zero.engine.comm.flight import Mark
from lightning_zero.faults.activity import Activity
from lightning_zero.faults.diagnosis_types import Context, Limits
from lightning_zero.faults.heartbeat import Peer, Record

LIMITS = Limits.for_timeout(8.0)
CONTEXT = Context(world_size=2)


def waiting(kind="reduce_scatter", op=16, seq=39, blocked_for=1.0, site="train.py:12 in training_step", via=None):
    return Activity(True, kind, op, seq, blocked_for, site, via)


def computing(seq=38, site="train.py:30 in training_step"):
    return Activity(False, None, None, seq, 0.0, site, None)


def record(rank, activity=None, phase="train", batch=2, **kwargs):
    return Record(rank=rank, activity=activity or computing(), phase=phase, batch=batch, **kwargs)


def peer(rec, age=0.5, liveness="alive"):
    return Peer(rec, age, liveness)


def marks(*entries):
    return [Mark(phase, count, count, ops, digest, seq) for phase, count, ops, digest, seq in entries]
