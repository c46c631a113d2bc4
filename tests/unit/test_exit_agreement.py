"""The exit agreement's last step, with two watchdogs of one process on a real TCPStore (no process group): the store's
host does not go on, and so cannot end its process and close the store, before every rank has read the outcome."""

import threading
from datetime import timedelta

import torch.distributed as dist

from lightning_zero.faults.activity import Activity
from lightning_zero.faults.diagnosis_types import Context, Limits
from lightning_zero.faults.watchdog import Watchdog


def test_rank_0_returns_from_the_agreement_only_once_every_rank_has_read_it():
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=30))
    limits = Limits.for_timeout(8.0)
    watchdogs = []
    for rank in (0, 1):
        client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=30))
        watchdog = Watchdog(client, "agreement", rank, 2, limits, Context(world_size=2), group=None, mark_peer=None)
        watchdog.exchange.outgoing = watchdog._record(Activity()).encode()
        watchdog.exchange.start()  # the exchange alone: no signal handlers, no watchdog thread
        watchdogs.append(watchdog)
    outcomes: dict[int, object] = {}
    peer = threading.Thread(target=lambda: outcomes.update({1: watchdogs[1].finish()}))
    peer.start()
    outcomes[0] = watchdogs[0].finish()
    left_when_rank_0_returned = server.add("agreement/left", 0)
    peer.join(timeout=30)
    for watchdog in watchdogs:
        watchdog.exchange.stop()
    assert outcomes == {0: None, 1: None}
    assert left_when_rank_0_returned == 2
