"""A gloo world of this process alone, for unit tests of code that needs a process group but no peers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist


@contextlib.contextmanager
def one_rank_world() -> Iterator[dist.ProcessGroup]:
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
