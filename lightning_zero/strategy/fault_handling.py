"""ZeroStrategy's wiring of ``faults/`` into Lightning: what the strategy's hooks call, and the only place
that knows Lightning's internals on the fault path (its SIGTERM handler).

Lifecycle of one run (``fit``, ``validate``, ``test`` or ``predict``):

* ``setup_environment`` -> :meth:`FaultHandling.start`: a run id shared by every rank (the store outlives
  runs), the watchdog thread (``watchdog=True``), the first-failure namespace.
* the first ``on_*_start`` -> :meth:`activate`: the run's collective timeout on every process group (see
  [Note: when the short timeout applies] in ``faults/timeouts.py``) and Lightning's SIGTERM handler replaced.
* each ``*_step`` -> :meth:`mark`: a step-boundary mark in the flight recorder.
* ``on_exception`` -> :meth:`on_exception`; ``teardown`` -> :meth:`finish` (the exit agreement).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from typing import Any

import torch.distributed as dist

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.flight import RECORDER, CollectiveError
from lightning_zero.faults import failures, signals
from lightning_zero.faults.diagnosis_types import Context, Limits
from lightning_zero.faults.timeouts import OpTimeouts, long_timeout
from lightning_zero.faults.watchdog import Watchdog
from lightning_zero.pipeline.split import pipeline_layout

log = logging.getLogger(__name__)


def symmetric_peer(config: Any, rank: int, world_size: int, node_size: int) -> int | None:
    """The rank whose step marks must equal this rank's (the watchdog compares them to catch silent divergence): one
    that issues the same collectives. That is the next rank, except under pipeline stages (the same stage of the next
    replica, if any) and hybrid sharding (the same place in the next replica group: the ranks of one shard group
    reduce different rows, of different sizes, across the replicas)."""
    stages = config.pipeline_stages
    if stages > 1:
        return (rank + stages) % world_size if world_size > stages else None
    shard_size, _ = config.group_sizes(world_size, node_size)
    return (rank + (shard_size if shard_size < world_size else 1)) % world_size


def pipeline_places(config: Any, world_size: int) -> tuple[str, ...]:
    """Per rank, the pipeline stages it runs and its replica, for the watchdog's messages (none without stages)."""
    if config.pipeline_stages == 1:
        return ()
    layout = pipeline_layout(config, world_size)
    places = []
    for rank in range(world_size):
        stages = layout.stages_of(rank)
        named = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
        places.append(f"pipeline {named} of replica {layout.replica(rank)}")
    return tuple(places)


class FaultHandling:
    """One per strategy; reused by every run of that strategy."""

    def __init__(self) -> None:
        self.watchdog: Watchdog | None = None
        self.timeouts: OpTimeouts | None = None
        self.namespace: str | None = None
        self.rank = 0
        self._active = False

    def start(self, config: Any, rank: int, world_size: int, node_size: int) -> None:
        """Right after the process group exists (every rank, collective)."""
        self.stop()
        self.rank = rank
        if world_size < 2 or not collectives.is_distributed():
            return
        # Uncounted: the communication tests count the model's collectives only.
        run = int(collectives.all_gather_uncounted(_random_id())[0].item())
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.namespace = f"{failures.PREFIX}/{restart}-{run:x}"
        limits = Limits.for_timeout(config.timeout_delta.total_seconds())
        pg_seconds = limits.pg_timeout if config.watchdog else limits.timeout
        self.timeouts = OpTimeouts(pg_seconds, long_timeout(config.timeout_delta))
        if not config.watchdog:
            return
        stages = config.pipeline_stages
        mark_peer = symmetric_peer(config, rank, world_size, node_size)
        context = Context(world_size=world_size, symmetric=stages == 1, places=pipeline_places(config, world_size))
        self.watchdog = Watchdog(
            _store_client(),
            self.namespace,
            rank,
            world_size,
            limits,
            context,
            dist.group.WORLD,
            mark_peer,
            long=self.timeouts.long,
        )
        self.watchdog.start()

    def activate(self, module: Any, gathers_in_forward: bool, trainer: Any = None) -> None:
        """The loops start (every ``on_*_start`` of a ``Trainer``, a Fabric module's setup; idempotent within a run).
        ``gathers_in_forward``: the engine all-gathers parameters inside ``module``'s forward (stage 3), where
        ``generate()`` with per-rank lengths desyncs. ``trainer``: its SIGTERM handler is replaced too."""
        if self.timeouts is None or self._active:
            return
        self._active = True
        self.timeouts.activate()
        RECORDER.on_mark = self.timeouts.refresh
        if self.watchdog is not None and gathers_in_forward and _has_generate(module):
            self.watchdog.context = dataclasses.replace(self.watchdog.context, generate_hint=True)
        if trainer is not None:
            _replace_lightning_sigterm(trainer)

    @staticmethod
    def mark(phase: str, args: tuple, kwargs: dict) -> None:
        """A step starts: record it (a few attribute writes) and raise the watchdog's diagnosis if armed."""
        if RECORDER.enabled or RECORDER.abort is not None:
            batch = args[1] if len(args) > 1 else kwargs.get("batch_idx")
            RECORDER.mark(phase, batch if isinstance(batch, int) else None)

    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, CollectiveError) and self.watchdog is None:
            return  # raised by the exit agreement, which recorded it
        if self.watchdog is not None:
            self.watchdog.on_exception(exception)
        elif self.namespace is not None:  # watchdog off: still name the first failure on every rank
            store = _store_client()
            mine = {
                "rank": self.rank,
                "culprit": self.rank,
                "kind": "error",
                "error": failures.error_text(exception),
                "message": f"rank {self.rank} raised {failures.error_text(exception)}",
            }
            try:
                first = failures.record(store, self.namespace, mine)
            except Exception:  # noqa: BLE001 - the store is gone with its host
                return
            if first is not mine and first.get("rank") != self.rank:
                failures.brought_down_by(exception, first, self.rank)

    def finish(self, succeeded: bool) -> CollectiveError | None:
        """Teardown: the exit agreement after a successful run, then the long timeouts back. Returns the error
        the strategy raises when a peer did not finish."""
        error = None
        if self.watchdog is not None and succeeded:
            error = self.watchdog.finish()
        self.stop()
        return error

    def stop(self) -> None:
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop()
        timeouts, self.timeouts = self.timeouts, None
        if timeouts is not None and self._active:
            timeouts.restore()
        self._active = False


def _random_id():
    import torch

    return torch.tensor([int.from_bytes(os.urandom(6), "little")], dtype=torch.int64)


def _store_client() -> Any:
    """A client of the process group's store for the watchdog's thread (a clone: its own connection)."""
    store = dist.distributed_c10d._get_default_store()
    clone = getattr(store, "clone", None)  # torch 2.13's Store has it but its stub does not; 2.14's stub has it
    if clone is None:  # an older store: share the main client
        return store
    try:
        return clone()
    except RuntimeError:  # a store that cannot clone itself: share the main client
        return store


def _has_generate(module: Any) -> bool:
    return module is not None and any(
        hasattr(m, "generate") and type(m).__module__.startswith("transformers.") for m in module.modules()
    )


def _replace_lightning_sigterm(trainer: Any) -> None:
    """Swap Lightning's SIGTERM notifier for one that never communicates (Lightning 2.6's calls ``dist.broadcast``
    inside the handler). Kept: its flag (``trainer.received_sigterm``, which its loops read at batch
    boundaries and then raise ``SIGTERMException`` on every rank), its ``launcher.kill``, and every other
    handler it chains (SLURM's, and whatever was installed before Lightning's). Lightning restores the
    handlers of before the run at its teardown."""
    connector = getattr(trainer, "_signal_connector", None)
    current = signal.getsignal(signal.SIGTERM)
    handlers = getattr(current, "signal_handlers", None)
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    if connector is None or signals.is_ours(current) or handlers is None or notifier not in handlers:
        return

    def notify(signum: int) -> None:
        log.info(f"[rank {trainer.global_rank}] Received SIGTERM: {signum}")
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        connector.received_sigterm = True

    signals.replace_handler(signal.SIGTERM, notify, [h for h in handlers if h != notifier])
