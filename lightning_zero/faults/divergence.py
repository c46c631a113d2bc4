"""Silent divergence: ranks that issued different collectives in the same step, seen in the step marks and the
recent collectives every rank publishes with its heartbeat (``engine/comm/flight.py``), before the run hangs."""

from __future__ import annotations

from lightning_zero.engine.comm.flight import Mark, Op
from lightning_zero.faults.diagnosis_types import EVAL_PHASES, GENERATE_HINT, Context, Diagnosis, generate_involved
from lightning_zero.faults.heartbeat import Record, step_name


def compare_marks(a: Record, b: Record, context: Context) -> Diagnosis | None:
    """Silent divergence: the first step both ranks marked whose counters differ."""
    theirs = {(m.phase, m.count): m for m in b.marks}
    previous: Mark | None = None
    for mark in a.marks:
        other = theirs.get((mark.phase, mark.count))
        if other is None:
            previous = None
            continue
        differs = mark.ops != other.ops or mark.digest != other.digest or (context.symmetric and mark.seq != other.seq)
        if differs:
            return _diverged(a, b, mark, other, previous, theirs, context)
        previous = mark
    return None


def _diverged(
    a: Record,
    b: Record,
    mark: Mark,
    other: Mark,
    previous: Mark | None,
    theirs: dict[tuple[str, int], Mark],
    context: Context,
) -> Diagnosis:
    before = theirs.get((previous.phase, previous.count)) if previous is not None else None
    if previous is not None and before is not None:
        span = f"during {step_name(previous.phase, previous.batch)} (before {step_name(mark.phase, mark.batch)} began)"
        issued_a, issued_b = mark.ops - previous.ops, other.ops - before.ops
    else:
        span = f"before {step_name(mark.phase, mark.batch)}"
        issued_a, issued_b = mark.ops, other.ops
    culprit: int | None
    first = first_difference(a.recent, b.recent, min(mark.ops, other.ops) + 1)
    if mark.ops == other.ops and mark.digest == other.digest:
        detail = (
            f"the same collectives of lightning_zero but different numbers of other torch.distributed operations "
            f"(world op {mark.seq} on rank {a.rank}, {other.seq} on rank {b.rank}: e.g. torchmetrics or "
            "Hugging Face generate's own all_reduce, or a torch.distributed call of your code)"
        )
        culprit = a.rank if mark.seq < other.seq else b.rank
    else:
        detail = f"{issued_a} collectives on rank {a.rank}, {issued_b} on rank {b.rank}"
        if first is not None:
            detail += f"; the first that differs is {first}"
        culprit = None if issued_a == issued_b else a.rank if issued_a < issued_b else b.rank
    # As many collectives, different ones: a branch each rank took its own way, with no rank behind the other.
    blame = (
        f"Rank {culprit} diverged (it issued fewer)."
        if culprit is not None
        else "Neither issued fewer: they took different branches that issue different collectives."
    )
    summary = (
        f"ranks {a.rank} and {b.rank} issued different collectives {span}: {detail}. {blame} "
        f"Rank {a.rank} is now {a.where()}; rank {b.rank} is {b.where()}."
    )
    hint = (
        GENERATE_HINT
        if generate_involved(mark.phase, (a, b), context)
        or (context.generate_hint and previous is not None and previous.phase in EVAL_PHASES)
        else ""
    )
    return Diagnosis("diverged", culprit, summary, hint)


def first_difference(mine: list[Op], theirs: list[Op], start: int, ranks: tuple[int, int] | None = None) -> str | None:
    """The first collective number (from the recent rings) where the two ranks issued different things;
    ``ranks``: the two ranks' numbers, to name them."""
    on = [f" on rank {r}" for r in ranks] if ranks else ["", ""]
    by_number = {op.number: op for op in theirs}
    for op in mine:
        other = by_number.get(op.number)
        if other is not None and op != other:
            return f"#{op.number}: {op.describe()}{on[0]} vs {other.describe()}{on[1]}"
    for op in mine:
        if op.number >= start and op.number not in by_number:
            never = f"rank {ranks[1]}" if ranks else "the other rank"
            return f"#{op.number}: {op.describe()}{on[0]}, which {never} never issued"
    return None
