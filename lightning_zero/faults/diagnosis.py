"""Deciding that a run cannot go on, and saying why: pure functions over heartbeat records (no processes,
no store, no clocks of their own), unit-tested in ``tests/unit/test_diagnosis.py``.

Every decision names a rank (the *culprit*: the one that failed, died, stopped, left early or diverged),
the collective by kind and number (``all_gather #412``, see ``flight.py``), the step, and the user's call
site when the sample knows it. Designed for NCCL's semantics, where a peer that dies or diverges is not
noticed by the transport: nothing here relies on a collective raising.

Order of the checks (the first that applies wins): a failure some rank already reported; a peer that
failed or whose process is gone; step marks that differ (silent divergence); a peer that finished while
this rank waits in a collective (uneven data); a peer without heartbeat (stopped, hung in native code, lost
with its node) or an unreachable store while this rank waits; finally this rank waiting in one collective
for ``timeout``, explained by what every peer is doing. What the decisions are made of (limits, context,
:class:`~lightning_zero.faults.diagnosis_types.Diagnosis`) is in ``diagnosis_types.py``; silent divergence in ``divergence.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_zero.faults.activity import Activity
from lightning_zero.faults.diagnosis_types import (
    GENERATE_HINT,
    MISMATCH_HINT,
    SAVE_HINT,
    Context,
    Diagnosis,
    Limits,
    generate_involved,
    saving_involved,
)
from lightning_zero.faults.divergence import compare_marks, first_difference
from lightning_zero.faults.heartbeat import FAILED, FINISHED, RUNNING, Peer, Record, phase_name, step_name


def adopt(failure: dict[str, Any], me: Record, kind: str | None = None) -> Diagnosis:
    """The first failure (of any rank, possibly this one's watchdog) as this rank's diagnosis."""
    summary = failure["message"]
    if failure.get("rank") != me.rank:
        reporter = failure.get("rank")
        by = f" (diagnosed by rank {reporter})" if reporter != failure.get("culprit") else ""
        summary = f"{summary}{by}\nThis rank ({me.rank}) was {me.where()}."
    return Diagnosis(kind or failure.get("kind", "failed"), failure.get("culprit"), summary)


def known_failure(me: Record, peers: dict[int, Peer], failure: dict[str, Any] | None) -> Diagnosis | None:
    """A failure already reported through the store, or one a peer's heartbeat shows."""
    if failure is not None:
        return adopt(failure, me)
    for rank, peer in sorted(peers.items()):
        found = peer_failed(rank, peer, me)
        if found is not None:
            return found
    return None


def decide(
    me: Record,
    peers: dict[int, Peer],
    failure: dict[str, Any] | None,
    limits: Limits,
    context: Context,
    mark_peer: int | None = None,
    store_silent: float = 0.0,
) -> Diagnosis | None:
    """The reason to end the run now, or None. Called every tick by the watchdog thread."""
    return _placed(_decide(me, peers, failure, limits, context, mark_peer, store_silent), context)


def _decide(
    me: Record,
    peers: dict[int, Peer],
    failure: dict[str, Any] | None,
    limits: Limits,
    context: Context,
    mark_peer: int | None,
    store_silent: float,
) -> Diagnosis | None:
    if (found := known_failure(me, peers, failure)) is not None:
        return found
    if mark_peer is not None and mark_peer in peers:
        found = compare_marks(me, peers[mark_peer].record, context)
        if found is not None:
            return found
    waiting = me.activity.in_collective
    for rank, peer in sorted(peers.items()):
        record = peer.record
        if record.state == FINISHED and waiting and _left_unmatched(me, record, limits, context):
            return finished_early(record, me, context)
    # Under NCCL the CPU does not wait inside the collective but at the next synchronisation, so a rank that has
    # made no progress for as long as a heartbeat may be missing counts as waiting too.
    if waiting or me.stalled >= limits.stale_after:
        for rank, peer in sorted(peers.items()):
            if peer.record.state == RUNNING and peer.silent(limits.stale_after):
                return stale(rank, peer, me)
        if store_silent >= limits.stale_after:
            return Diagnosis(
                "store",
                0,
                f"rank {me.rank} cannot reach the rendezvous store for {store_silent:.0f} s while it waits in a "
                f"collective ({me.where()}). The store lives in rank 0's process when Lightning or "
                "MASTER_ADDR/MASTER_PORT started the run (torchrun's agent hosts it otherwise): rank 0 is "
                "probably stopped or lost with its node.",
            )
        if waiting and me.activity.blocked_for >= limits.timeout:
            return stuck(me, peers, limits, context)
    return None


def peer_failed(rank: int, peer: Peer, me: Record | None = None) -> Diagnosis | None:
    record = peer.record
    if peer.liveness == "dead" and record.crash:
        return crashed(record, me)
    if record.state == FAILED:
        return Diagnosis("failed", rank, f"rank {rank} failed ({record.error or 'error'}); it was {record.where()}")
    if peer.liveness == "dead" and record.state == RUNNING and record.signal:
        return Diagnosis(
            "sigterm",
            rank,
            f"rank {rank}'s process ended after it received {record.signal}; it was last seen {record.where()}.",
        )
    if peer.liveness == "dead" and record.state == RUNNING:
        return Diagnosis(
            "died",
            rank,
            f"rank {rank}'s process ended without reporting an error (killed, e.g. by SIGKILL or the out-of-memory "
            "killer, or crashed in native code: gloo aborts a process whose collective does not match its peer's, "
            f"see that rank's output); it was last seen {record.where()}.",
        )
    return None


def crashed(record: Record, me: Record | None) -> Diagnosis:
    """A peer's process died of a fatal signal; its black box (``postmortem.py``) says what it was doing then."""
    rank, activity = record.rank, record.activity
    if activity.in_collective:
        op = next((o for o in record.recent if o.number == activity.op), None)
        doing = f"in {op.describe() if op else f'{activity.kind} #{activity.op}'}"
    else:
        doing = "not in a collective" + (f" (the last it issued: {activity.last})" if activity.last else "")
    site = f", called from {activity.site}" if activity.site else ""
    summary = (
        f"rank {rank}'s process crashed in native code ({record.crash}) in "
        f"{step_name(record.phase, record.batch)}, {doing}{site}."
    )
    hint = ""
    first = (
        None
        if me is None
        else first_difference(record.recent, me.recent, min(record.ops, me.ops) + 1, ranks=(rank, me.rank))
    )
    # gloo may abort in its background thread after the collective returned on the Python side: the black box then
    # says "not in a collective", and the differing records are what tell a mismatch
    if record.crash and record.crash.startswith("SIGABRT") and (activity.in_collective or first is not None):
        summary += (
            " gloo aborts a process whose collective does not match its peer's (that rank's output says "
            "'Is there a distributed collective mismatch in your code?')."
        )
        hint = MISMATCH_HINT
    if first is not None:
        summary += f" The ranks issued different collectives; the first that differs is {first}."
    if me is not None:
        summary += f" This rank ({me.rank}) is {me.where()}."
    if any("generation" in (r.activity.via or "") for r in (record, me) if r is not None):
        hint = GENERATE_HINT
    return Diagnosis("crashed", rank, summary, hint)


def stale(rank: int, peer: Peer, me: Record) -> Diagnosis:
    state = {
        "stopped": " (its process is stopped: SIGSTOP or a debugger)",
        "alive": " (its process exists but its watchdog cannot run: hung in native code?)",
    }.get(peer.liveness, "")
    return Diagnosis(
        "stale",
        rank,
        f"rank {rank} stopped responding: no heartbeat for {peer.age:.0f} s{state}. It was last seen "
        f"{peer.record.where()}. This rank ({me.rank}) is {me.where()}.",
        "If that rank is busy but healthy in a long one-sided phase, raise `ZeroStrategy(timeout=...)` or wrap the "
        "phase in `lightning_zero.faults.extended(seconds, reason)` on every rank.",
    )


def _left_unmatched(me: Record, finished: Record, limits: Limits, context: Context) -> bool:
    """Whether ``finished``, which ended its loop, left the collective ``me`` waits in without its side.

    Symmetric ranks issue the same operations in the same order, so the numbers tell at once. ``collectives.py``
    numbers its operations on every group alike: a peer whose count reached the number ``me`` waits in issued
    that operation, and ``me``'s wait is only the time its process was not scheduled (seconds, on a loaded
    machine; the peer may even have issued the next ones asynchronously). For other callers' operations the world
    group's sequence number tells the same, except when the numbers are equal (``me`` may wait in a subgroup's
    operation). Then, and for pipeline ranks, which issue different operations, the length of the wait decides."""
    if context.symmetric and me.activity.op:
        return finished.ops < me.activity.op
    mine, theirs = me.activity.seq, finished.seq or finished.activity.seq
    if context.symmetric and mine and theirs:
        if mine > theirs:
            return True
        if mine < theirs:
            return False
    return me.activity.blocked_for >= limits.settle


def finished_early(finished: Record, running: Record, context: Context) -> Diagnosis:
    """``finished`` ended its loop while ``running`` still waits in a collective that rank never joins."""
    phase = running.phase or finished.phase
    summary = (
        f"rank {finished.rank} finished ({finished.steps_in(phase)} {phase_name(phase)} batches, {finished.ops} "
        f"collectives) while rank {running.rank} still runs: it is {running.where()}. Rank {running.rank} waits for a "
        f"collective rank {finished.rank} will never join: the ranks ran different numbers of batches, or issued "
        "different numbers of collectives in a batch."
    )
    hint = (
        "Give every rank the same number of batches: Lightning's DistributedSampler does "
        "(`use_distributed_sampler=True`); with an IterableDataset or your own sampler, make the per-rank "
        "lengths equal (drop or pad the remainder)."
    )
    if generate_involved(phase, (finished, running), context):
        hint = GENERATE_HINT
    if saving_involved((running,)):
        hint = SAVE_HINT
    return Diagnosis("finished", finished.rank, summary, hint)


def stuck(me: Record, peers: dict[int, Peer], limits: Limits, context: Context) -> Diagnosis:
    """This rank waited ``timeout`` in one collective: which peer is not in it, and what it does instead."""
    mine = me.activity
    absent, elsewhere, alongside = [], [], []
    for rank, peer in sorted(peers.items()):
        other = peer.record.activity
        if not other.in_collective:
            absent.append(rank)
        elif other.kind == mine.kind and ((mine.op and other.op == mine.op) or other.seq == mine.seq):
            alongside.append(rank)
        else:
            elsewhere.append(rank)
    site = (f", called from {mine.site}" if mine.site else "") + (f" via {mine.via}" if mine.via else "")
    head = (
        f"rank {me.rank} waited {mine.blocked_for:.0f} s (timeout={limits.timeout:g} s) in {_collective(mine)}"
        f"{site}, in {step_name(me.phase, me.batch)}"
    )
    hint = (
        "If that rank is just slow here (one-sided work such as evaluation on rank 0 only), raise "
        "`ZeroStrategy(timeout=...)` or wrap the work in `lightning_zero.faults.extended(seconds, reason)` on "
        "every rank."
    )
    if elsewhere:
        culprit = elsewhere[0]
        record = peers[culprit].record
        summary = (
            f"{head}; rank {culprit} is in a different collective: {record.where()}. The ranks issued "
            "different collectives (a collective issued on some ranks only: a skipped step, a conditional "
            "`self.log(..., sync_dist=True)`, a submodule used on some ranks only under stage 3, ...)."
        )
        hint = GENERATE_HINT if generate_involved(me.phase, (me, record), context) else ""
        if saving_involved((me, record)):
            hint = SAVE_HINT
        return Diagnosis("diverged", culprit, summary, hint)
    if absent:
        culprit = absent[0]
        names = ", ".join(f"rank {r} is {peers[r].record.where()}" for r in absent)
        summary = f"{head}; rank(s) {', '.join(map(str, absent))} did not join it: {names}."
        if generate_involved(me.phase, (me, *(peers[r].record for r in absent)), context):
            hint = GENERATE_HINT
        if saving_involved((me, *(peers[r].record for r in absent))):
            hint = SAVE_HINT
        return Diagnosis("stuck", culprit, summary, hint)
    summary = (
        f"{head}; every rank observed ({', '.join(map(str, alongside)) or 'none'}) waits in it too: the "
        "collective itself does not complete (the network, or a rank this one does not observe)."
    )
    return Diagnosis("stuck", None, summary, hint)


def _collective(activity: Activity) -> str:
    if activity.op:
        return f"{activity.kind} #{activity.op} (world op {activity.seq})"
    return f"torch.distributed.{activity.kind} (world op {activity.seq})"


def exit_agreement(
    me: Record, peers: dict[int, Peer], failure: dict[str, Any] | None, limits: Limits, context: Context, waited: float
) -> Diagnosis | None | bool:
    """At the end of a successful run: True when every rank finished, a Diagnosis when this rank must fail after
    all (a peer failed, died, or waits in a collective this rank never joins), None to keep waiting."""
    return _placed(_exit_agreement(me, peers, failure, limits, context, waited), context)


def _exit_agreement(
    me: Record, peers: dict[int, Peer], failure: dict[str, Any] | None, limits: Limits, context: Context, waited: float
) -> Diagnosis | None | bool:
    if (found := known_failure(me, peers, failure)) is not None:
        return found
    running = {r: p for r, p in peers.items() if p.record.state != FINISHED}
    if not running:
        return True
    blocked = [
        r
        for r, p in running.items()
        if p.record.activity.in_collective and _left_unmatched(p.record, me, limits, context)
    ]
    if len(blocked) == len(running):  # nobody left to make progress: they wait for a rank that finished
        return finished_early(me, running[blocked[0]].record, context)
    stale_ranks = [r for r, p in running.items() if p.silent(limits.stale_after)]
    if stale_ranks:
        return stale(stale_ranks[0], running[stale_ranks[0]], me)
    if waited >= limits.timeout:
        rank = min(running)
        return Diagnosis(
            "stuck",
            rank,
            f"rank {me.rank} finished, but rank {rank} did not finish within timeout={limits.timeout:g} s: it is "
            f"{running[rank].record.where()}.",
        )
    return None


def explain(me: Record, peers: dict[int, Peer], limits: Limits, context: Context, error: str) -> Diagnosis:
    """Why a collective raised on this rank (gloo's "Connection closed by peer", a timeout, a mismatch) when no
    decision was made yet: what the peers are doing, from their last records."""
    found = _explain(me, peers, limits, context, error)
    return dataclasses.replace(found, summary=context.placed(found.summary))


def _explain(me: Record, peers: dict[int, Peer], limits: Limits, context: Context, error: str) -> Diagnosis:
    if me.paused >= limits.stale_after:
        return Diagnosis(
            "stale",
            me.rank,
            f"rank {me.rank}'s process could not run for {me.paused:.0f} s (stopped by SIGSTOP or a debugger, or the "
            f"machine was swapping), and the other ranks ended the run meanwhile; it is {me.where()}.",
        )
    for rank, peer in sorted(peers.items()):
        found = peer_failed(rank, peer, me)
        if found is not None:
            return found
        if peer.record.state == FINISHED:
            return finished_early(peer.record, me, context)
    for peer in peers.values():
        diverged = compare_marks(me, peer.record, context)
        if diverged is not None:
            return diverged
    first_line = error.strip().splitlines()[0][:300] if error.strip() else "an error"
    if peers:
        summary = f"a collective failed on rank {me.rank} ({first_line}) while it was {me.where()}; " + "; ".join(
            f"rank {r} was last seen ({p.age:.0f} s ago) {p.record.where()}" for r, p in sorted(peers.items())
        )
        culprit = next((r for r, p in sorted(peers.items()) if not p.record.activity.same_wait(me.activity)), None)
        return Diagnosis("stuck", culprit, summary)
    return Diagnosis(
        "stuck",
        None,
        f"a collective failed on rank {me.rank} ({first_line}) {me.where()}; no peer "
        "record could be read (the store is unreachable).",
    )


def _placed(found: Any, context: Context) -> Any:
    """Under pipeline stages, each rank a diagnosis names is followed by the stages it runs."""
    if isinstance(found, Diagnosis) and context.places:
        return dataclasses.replace(found, summary=context.placed(found.summary))
    return found
