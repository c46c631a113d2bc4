"""The per-attempt key space inside torchrun's shared agent store (lightning_zero/strategy/attempt_store.py), with the
ranks of each attempt as threads over one real TCPStore, as torchrun's agent hosts it across restarts. The real
restarts under torchrun are tests/integration/test_auto_resume.py (``LATE_RESTART``)."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_zero.strategy import attempt_store as attempt_store_module
from lightning_zero.strategy.attempt_store import AttemptStoreError, attempt_store, say_ended


@pytest.fixture
def agent_store():
    """The agent's store: it outlives every attempt's workers. The threads' ranks share this process's record of
    the generations it joined, which a new agent store starts without."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), multi_tenant=True)
    attempt_store_module._JOINED.clear()
    yield store
    attempt_store_module._JOINED.clear()


def attempt(
    agent_store,
    world_size: int,
    start_after: dict[int, float] | None = None,
    timeout: float = 20,
    ranks: list[int] | None = None,
) -> dict[int, dist.Store]:
    """One torchrun attempt: each rank (a thread) joins after its delay; returns every rank's store."""
    start_after = start_after or {}

    def rank(r: int) -> dist.Store:
        time.sleep(start_after.get(r, 0.0))
        return attempt_store("127.0.0.1", agent_store.port, r, world_size, timedelta(seconds=timeout), 60.0)

    ranks = list(range(world_size)) if ranks is None else ranks
    with ThreadPoolExecutor(len(ranks)) as pool:
        return dict(zip(ranks, pool.map(rank, ranks)))


def shares_one_key_space(stores: dict[int, dist.Store]) -> bool:
    token = f"token-{time.monotonic_ns()}"
    stores[0].set("probe", token)
    return all(s.get("probe") == token.encode() for s in stores.values())


def test_the_ranks_of_one_attempt_share_a_key_space_that_the_next_attempt_does_not_see(agent_store):
    first = attempt(agent_store, 2)
    assert shares_one_key_space(first)
    first[1].set("rank_1_address", "previous")  # as gloo's address of a rank of the first attempt
    second = attempt(agent_store, 2)
    assert shares_one_key_space(second)
    assert not second[0].check(["rank_1_address"])  # the previous attempt's keys are out of sight


@pytest.mark.parametrize("late_rank", [0, 1])
def test_a_late_rank_of_a_restarted_attempt_joins_its_own_attempt(agent_store, late_rank):
    """Rank 1 first (it finds the previous attempt's full generation) or rank 0 first (rank 1 then reads the new one)."""
    attempt(agent_store, 2)
    restarted = attempt(agent_store, 2, start_after={late_rank: 1.0})
    assert shares_one_key_space(restarted)


def test_an_attempt_whose_rank_died_before_joining_does_not_trap_the_next(agent_store):
    """The previous attempt's rank 1 died before it joined (its rank 0 waited, then was stopped by torchrun): that
    generation stays open, and the next attempt's rank 1 may find it first."""
    with pytest.raises(AttemptStoreError):
        attempt(agent_store, 2, timeout=1.5, ranks=[0])
    restarted = attempt(agent_store, 2, start_after={0: 1.0})
    assert shares_one_key_space(restarted)


def test_an_elastic_restart_with_another_world_size(agent_store):
    attempt(agent_store, 2)
    grown = attempt(agent_store, 3, start_after={0: 0.5})
    assert shares_one_key_space(grown)


def test_a_rank_that_never_arrives_is_named_within_the_timeout(agent_store, capsys):
    """Ranks 0 and 1 of 3 start; rank 2 never does. Rank 0 says so while it waits, and fails after the timeout."""
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        rank_1 = pool.submit(attempt_store, "127.0.0.1", agent_store.port, 1, 3, timedelta(seconds=2), 60.0)
        with pytest.raises(AttemptStoreError, match=r"rank 0 waited 2 s for rank\(s\) \[2\] of this torchrun attempt"):
            attempt_store("127.0.0.1", agent_store.port, 0, 3, timedelta(seconds=2), notice_after=0.5)
        waiting = r"rank 1 waited 2 s for the other ranks of this torchrun attempt to start \(rank 0 opens it when all 3 have\)"
        with pytest.raises(AttemptStoreError, match=waiting):
            rank_1.result()
    assert time.monotonic() - started < 5
    assert re.search(
        r"rank 0: waiting \d s so far for rank\(s\) \[2\] of this torchrun attempt", capsys.readouterr().err
    )


@pytest.mark.parametrize("ended", [0, 1])
def test_a_rank_that_ended_its_script_is_named_at_once_by_a_peer_starting_another_run(agent_store, ended):
    """Both ranks ran; one then ends its script (rank 0 alone calls ``trainer.test``, or rank 1 does): its peer's next
    run fails in seconds, naming it, not after the rendezvous timeout. A run both ranks start is not affected."""
    attempt(agent_store, 2)
    assert shares_one_key_space(attempt(agent_store, 2))  # a second run of both ranks
    say_ended(rank=ended)
    started = time.monotonic()
    peer = 1 - ended
    with pytest.raises(
        AttemptStoreError,
        match=rf"rank {peer} starts another run, but rank\(s\) \[{ended}\] ended their "
        r"script after the last one",
    ):
        attempt(agent_store, 2, ranks=[peer], timeout=20)
    assert time.monotonic() - started < 5
