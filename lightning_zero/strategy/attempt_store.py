"""A key space of its own for each torchrun attempt, inside torchrun's shared agent store.

[Note: torchrun's shared store across restarts]
With the c10d rendezvous, torch 2.13's torchrun agent hosts one TCPStore for its whole life and points every
attempt's workers at it (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_PORT`` unchanged across restarts), and
``init_process_group`` adds no per-attempt prefix. So the keys of a killed attempt are still there when torchrun
restarts the job: gloo's address of each rank, the store-based barrier's counters. A restarted rank that reaches
``init_process_group`` a few seconds after its peers lets them read its *previous* address (measured with plain
torch, ranks 15 s apart: ``Gloo connectFullMesh failed ... Connection refused`` in one of five restarts and a
hang in another). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it, but must be set for the agent, where a
user following the docs does not know to set it.

So ZeroStrategy gives the process group a :class:`~torch.distributed.PrefixStore` of its own per attempt. The
attempt is a *generation* number that the ranks of one attempt agree on through the store itself, with no clock
and no restart count (torchrun's count differs between nodes: an agent whose workers were alive restarts them
with its count unchanged):

* rank 0 increments ``generation`` and waits until ``world_size - 1`` ranks have joined that generation, then
  marks it ready;
* every other rank reads ``generation`` and joins it (a counter of that generation). It may read an earlier
  attempt's number, when it starts before this attempt's rank 0 did. Such a generation is either full (its own
  ranks all joined it: the join counts past ``world_size - 1``) or never becomes ready (its rank 0 is dead:
  torchrun stops every worker of an attempt before it starts the next). Either way the rank moves on as soon
  as ``generation`` grows, which this attempt's rank 0 does exactly once.

The counters are namespaced by the world size, so an elastic restart with another size cannot mistake an
earlier attempt's full generation for an open one.

A rank whose script ends writes so into the generation it last joined. A peer that starts another run in the same
process (a second ``fit``, or a ``test`` made on rank 0 alone) then fails at once, naming it, where it would wait
for the rendezvous timeout for a rank that will never come: torchrun stops the other workers when one fails, but
not when one ends well.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

ROOT = "lightning_zero/attempt"
GENERATION = f"{ROOT}/generation"
#: Seconds between two looks at the store while a rank waits for its peers to join (a few store round trips).
POLL_SECONDS = 0.02
#: How long a process at exit tries to say it ended.
ENDED_TIMEOUT = timedelta(seconds=2)


#: (rank, world size) -> the agent store's client and the generation this process last joined as that rank.
_JOINED: dict[tuple[int, int], tuple[dist.Store, int]] = {}


class AttemptStoreError(RuntimeError):
    """The ranks of this torchrun attempt did not all reach the process group's set-up in time."""


def uses_torchrun_shared_store() -> bool:
    """Whether torchrun pointed this worker at its agent's long-lived store (torch's own test of it)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def attempt_store(
    address: str, port: int, rank: int, world_size: int, timeout: timedelta, notice_after: float
) -> dist.Store:
    """A client of torchrun's agent store at ``address:port``, prefixed with this attempt's generation.
    Raises :class:`AttemptStoreError` after ``timeout``; says on stderr what it waits for after ``notice_after``
    seconds."""
    store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    joining = _Joining(store, rank, world_size, timeout.total_seconds(), notice_after)
    generation = joining.lead() if rank == 0 else joining.follow()
    if not _JOINED:
        atexit.register(say_ended)
    _JOINED[(rank, world_size)] = (store, generation)
    return dist.PrefixStore(f"{ROOT}/{generation}", store)


def say_ended(rank: int | None = None) -> None:
    """Mark, in the generation it last joined, that this process's rank (``rank``: that one only) ended its script;
    run at exit. The agent's store may be gone by then (torchrun stopping): nothing to tell anyone."""
    for (joined_rank, world_size), (store, generation) in list(_JOINED.items()):
        if rank is None or rank == joined_rank:
            try:
                store.set_timeout(ENDED_TIMEOUT)
                store.set(_key(generation, world_size, f"ended{joined_rank}"), "1")
            except (RuntimeError, OSError):
                pass


def _key(generation: int, world_size: int, name: str) -> str:
    return f"{ROOT}/{generation}/world{world_size}/{name}"


class _Joining:
    """One rank's side of the generation agreement (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float, notice_after: float) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.notice_at: float | None = self.started + notice_after
        #: The generation this process joined as this rank before, if it did: where peers that ended say so.
        self.previous = _JOINED[(rank, world_size)][1] if (rank, world_size) in _JOINED else None

    def lead(self) -> int:
        generation = self.store.add(GENERATION, 1)
        while self.store.add(self._key(generation, "joined"), 0) < self.world_size - 1:
            self._refuse_ended(self._absent(generation))
            self._wait(lambda: f"rank(s) {self._absent(generation)} of this torchrun attempt to start")
        self.store.set(self._key(generation, "ready"), "1")
        return generation

    def follow(self) -> int:
        while True:
            generation = self.store.add(GENERATION, 0)
            if self.store.add(self._key(generation, "joined"), 1) <= self.world_size - 1:
                self.store.set(self._key(generation, f"rank{self.rank}"), "1")
                while not self.store.check([self._key(generation, "ready")]):
                    if self.store.add(GENERATION, 0) > generation:
                        break  # an earlier attempt's generation, whose rank 0 is gone: join the new one
                    self._refuse_ended([r for r in range(self.world_size) if r != self.rank])
                    self._wait(
                        lambda: (
                            "the other ranks of this torchrun attempt to start (rank 0 opens it when all "
                            f"{self.world_size} have)"
                        )
                    )
                else:
                    return generation
            else:  # full: an earlier attempt's; this attempt's rank 0 has not started yet
                while self.store.add(GENERATION, 0) == generation:
                    self._refuse_ended([r for r in range(self.world_size) if r != self.rank])
                    self._wait(lambda: "rank 0 of this torchrun attempt to start")

    def _wait(self, waiting_for) -> None:
        now = time.monotonic()
        if now > self.deadline:
            raise AttemptStoreError(
                f"rank {self.rank} waited {now - self.started:.0f} s for {waiting_for()} (the process group's "
                "set-up under torchrun); a rank that never got here failed or hangs before `Trainer.fit`: see "
                "its output above."
            )
        if self.notice_at is not None and now > self.notice_at:
            self.notice_at = None
            print(
                f"[lightning_zero] rank {self.rank}: waiting {now - self.started:.0f} s so far for {waiting_for()}.",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(POLL_SECONDS)

    def _refuse_ended(self, ranks: list[int]) -> None:
        """Fail at once if one of ``ranks`` ended its script after the run this process shared with it last."""
        if self.previous is None:
            return
        ended = [r for r in ranks if self.store.check([_key(self.previous, self.world_size, f"ended{r}")])]
        if ended:
            raise AttemptStoreError(
                f"rank {self.rank} starts another run, but rank(s) {ended} ended their script after the last one and "
                "will not start it: every rank must make the same Trainer calls (a `trainer.test(...)` or `fit` under "
                "`if trainer.is_global_zero:` runs on rank 0 alone)."
            )

    def _absent(self, generation: int) -> list[int]:
        return [r for r in range(1, self.world_size) if not self.store.check([self._key(generation, f"rank{r}")])]

    def _key(self, generation: int, name: str) -> str:
        return _key(generation, self.world_size, name)
