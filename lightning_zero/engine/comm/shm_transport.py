"""All-gather and reduce-scatter through shared memory, for the ranks of a gloo group that share one host.

[Note: shared-memory collectives]
gloo moves every byte through a TCP socket, even between processes on one host: the kernel copies it in and out, and
gloo's threads spend CPU a CPU-bound training step does not have to spare. Through a mailbox in ``/dev/shm`` each rank
copies its data in once and reads its peers' once, as DeepSpeed's CPU backend does
(``benchmarks/results/2026-11-26-cpu-step-time.md``).

A collective runs in rounds that fit the mailboxes: every rank writes its part, a barrier, every rank reads what it
needs, a barrier, so no mailbox is overwritten while a peer still reads it. It does not overlap computation, but it
costs the CPU far less than the socket did, and on a machine with a core per rank that is what a step waits for. A
reduce-scatter sums in rank order, the same on every rank.

A group uses the mailboxes when every rank reports the same host and each could reserve its mailbox
(``posix_fallocate``, so a full ``/dev/shm`` is refused here, never met later as a SIGBUS); otherwise it keeps the
socket ring. The files are unlinked as soon as every rank has mapped them, so a killed process leaves nothing behind
in ``/dev/shm``.
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

MAILBOX_BYTES = 16 * 2**20
_DIRECTORY = "/dev/shm"
_GROUPS: dict[object, "SharedMemoryGroup | None"] = {}
Collective = Callable[[torch.Tensor, torch.Tensor], None]


def enabled() -> bool:
    return os.environ.get("LIGHTNING_ZERO_SHM_COLLECTIVES", "0") == "1" and os.path.isdir(_DIRECTORY)


def for_group(group: dist.ProcessGroup | None) -> "SharedMemoryGroup | None":
    """Collective on first use: every rank of the group calls this at the same point, as it calls the collective
    that needs it."""
    key = group if group is not None else dist.group.WORLD
    if key not in _GROUPS:
        _forget_destroyed_groups()
        _GROUPS[key] = SharedMemoryGroup.open(group) if enabled() else None
    return _GROUPS[key]


def _forget_destroyed_groups() -> None:
    """A test or a second ``fit`` builds new groups."""
    alive = dist.distributed_c10d._world.pg_map
    for key in [key for key in _GROUPS if key not in alive]:
        mailboxes = _GROUPS.pop(key)
        if mailboxes is not None:
            mailboxes.close()


class MailboxWork(dist.Work):
    def __init__(self, run: Collective, output: torch.Tensor, input: torch.Tensor) -> None:
        super().__init__()
        self.run: Collective | None = run
        self.output: torch.Tensor | None = output
        self.input: torch.Tensor | None = input
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True


class SharedMemoryGroup:
    """One group's mailboxes (see [Note: shared-memory collectives])."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        maps: list[mmap.mmap],
        rank: int,
        sync_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group, self.maps, self.rank, self.size = group, maps, rank, len(maps)
        #: The mailbox thread's barriers need a group of their own: the training thread's collectives on ``group`` must
        #: not interleave with them. None: collectives run in the calling thread.
        self.sync_group = sync_group
        self._queue: queue.SimpleQueue[MailboxWork | None] | None = None
        self._failure: BaseException | None = None
        if sync_group is not None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._serve, name="lightning_zero-mailboxes", daemon=True).start()

    def submit(self, collective: Collective, output: torch.Tensor, input: torch.Tensor) -> MailboxWork | None:
        if self._queue is None:
            collective(output, input)
            return None
        work = MailboxWork(collective, output, input)
        self._queue.put(work)
        return work

    def _serve(self) -> None:
        if self._queue is None:
            raise RuntimeError("lightning_zero internal error: the thread starts only with its queue")
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                if self._failure is not None:  # a peer is gone: every later collective fails alike
                    raise self._failure
                if work.run is None or work.output is None or work.input is None:
                    raise RuntimeError("lightning_zero internal error: not yet run")
                work.run(work.output, work.input)
            except BaseException as error:
                self._failure = self._failure or error
                work.error = error
            finally:
                work.run = work.output = work.input = None  # the caller holds what it still needs
                work.done.set()
                del work  # nor does this thread keep the last buffers alive while it waits for the next

    @classmethod
    def open(cls, group: dist.ProcessGroup | None) -> "SharedMemoryGroup | None":
        from lightning_zero.engine.comm import collectives  # collectives imports this module

        rank = dist.get_rank(group)
        hosts = collectives.all_gather_objects((socket.gethostname(), _boot_id()), group=group)
        if len(set(hosts)) != 1:
            return None
        token = collectives.broadcast_object(
            uuid.uuid4().hex if rank == 0 else None,
            src=dist.get_global_rank(group, 0) if group is not None else 0,
            group=group,
        )
        path = os.path.join(_DIRECTORY, f"lightning_zero-{token}-{rank}")
        reserved = _reserve(path)
        maps: list[mmap.mmap] = []
        try:
            if not all(collectives.all_gather_objects(reserved, group=group)):
                return None
            try:
                for peer in range(len(hosts)):
                    with open(os.path.join(_DIRECTORY, f"lightning_zero-{token}-{peer}"), "r+b") as file:
                        maps.append(mmap.mmap(file.fileno(), MAILBOX_BYTES))
            except OSError:  # a peer's /dev/shm is not ours (another container on this host)
                maps = []
            if not all(collectives.all_gather_objects(bool(maps), group=group)):  # every rank tried to map
                for mapped in maps:
                    mapped.close()
                return None
        finally:
            if reserved:
                os.unlink(path)
        # The thread's barrier group can be built only where every rank of the world is here: a group of all ranks.
        whole = group is None or dist.get_world_size(group) == dist.get_world_size()
        barrier_group = dist.new_group(backend="gloo") if whole else None
        if barrier_group is not None and not isinstance(barrier_group, dist.ProcessGroup):  # torch 2.14's -100
            raise RuntimeError(
                f"the shared-memory barrier group holds every rank, yet torch returned {barrier_group!r}"
            )
        return cls(group, maps, rank, barrier_group)

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
        for mapped in self.maps:
            try:
                mapped.close()
            except BufferError:  # a view is still alive; the mapping goes with the process
                pass
        self.maps = []

    def _box(self, peer: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.frombuffer(self.maps[peer], dtype=torch.uint8, count=numel * dtype.itemsize).view(dtype)

    def _barrier(self) -> None:
        dist.barrier(group=self.sync_group if self.sync_group is not None else self.group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        seg = input.numel()
        rows = output.view(self.size, seg)
        step = MAILBOX_BYTES // input.element_size()
        source = input.reshape(-1)
        for start in range(0, seg, step):
            width = min(step, seg - start)
            self._box(self.rank, input.dtype, width).copy_(source[start : start + width])
            self._barrier()
            for peer in range(self.size):
                part = source[start : start + width] if peer == self.rank else self._box(peer, input.dtype, width)
                rows[peer, start : start + width].copy_(part)
            self._barrier()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        seg = output.numel()
        columns = input.view(self.size, seg)
        step = MAILBOX_BYTES // (input.element_size() * self.size)
        for start in range(0, seg, step):
            width = min(step, seg - start)
            self._box(self.rank, input.dtype, self.size * width).view(self.size, width).copy_(
                columns[:, start : start + width]
            )
            self._barrier()
            out = output.view(-1)[start : start + width]
            for peer in range(self.size):
                part = (
                    columns[self.rank, start : start + width]
                    if peer == self.rank
                    else self._box(peer, input.dtype, self.size * width).view(self.size, width)[self.rank]
                )
                if peer == 0:
                    out.copy_(part)
                else:
                    out.add_(part)
            self._barrier()


def _reserve(path: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, MAILBOX_BYTES)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)


def _boot_id() -> str:
    """Hosts that share a name (containers on different machines) differ in boot id. Containers of one machine
    share it but may not share ``/dev/shm``: mapping a peer's file fails there, and the group keeps the ring."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return ""
