"""Collectives as point-to-point transfers over gloo, for ``collectives.py``: the textbook rings, and the exchanges that
move stages 1-2's rows without packed buffers.

[Note: ring collectives over gloo]
gloo's reduce_scatter_tensor and all_gather_into_tensor are slower on CPU than a ring of point-to-point transfers moving
the same bytes (``benchmarks/results/2026-11-21-gloo-rings.md``), so over gloo we run the textbook ring. The first
step's transfers are posted at once and proceed in gloo's threads, so a bucket's reduction overlaps backward; with 2
ranks that is the whole collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_zero.engine.comm.flight import RECORDER as _FLIGHT

#: See ``collectives.set_wait_timeout``.
WAIT_TIMEOUT: timedelta | None = None


class Ring(dist.Work):
    """A ``dist.Work`` (FSDP2 waits only on those), whose ``wait`` runs the remaining ring steps."""

    kind = ""

    def __init__(self, group: dist.ProcessGroup | None, number: int) -> None:
        super().__init__()
        self.group = group
        self.number = number
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group else (self.rank - 1) % self.size
        self.step = 0
        self.pending: list[dist.Work | None] = []

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self.pending = [dist.isend(send, self.next, group=self.group), dist.irecv(recv, self.prev, group=self.group)]

    def _complete(self) -> None:
        with record_function("lightning_zero::wait"):
            for request in self.pending:
                if request is None:
                    raise RuntimeError("lightning_zero internal error: a ring step posted on a rank outside its group")
                if WAIT_TIMEOUT is None:
                    request.wait()
                else:
                    request.wait(WAIT_TIMEOUT)
        self.pending = []


class RingReduceScatter(Ring):
    """The last step receives straight into ``output`` (which must not alias ``input``) and adds this rank's segment
    there: with 2 ranks no buffer at all, and the same two-term sums."""

    kind = "reduce_scatter"

    def __init__(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, number: int = 0
    ) -> None:
        super().__init__(group, number)
        self.output = output
        self.acc = input.view(self.size, -1)
        self.recv = torch.empty_like(self.acc[0]) if self.size > 2 else output
        self._post()

    def _last(self) -> bool:
        return self.step == self.size - 2

    def _post(self) -> None:
        self._exchange(self.acc[(self.rank - self.step - 1) % self.size], self.output if self._last() else self.recv)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """``timeout`` is unused: :data:`WAIT_TIMEOUT` bounds each step."""
        _FLIGHT.wait(self.number, self.kind)
        while self.pending:
            self._complete()
            if self._last():
                self.output.add_(self.acc[self.rank])
            else:
                self.acc[(self.rank - self.step - 2) % self.size].add_(self.recv)
            self.step += 1
            if self.step < self.size - 1:
                self._post()
        _FLIGHT.done(self.number)
        return True


class RingAllGather(Ring):
    kind = "all_gather"

    def __init__(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, number: int = 0
    ) -> None:
        super().__init__(group, number)
        self.acc = output.view(self.size, -1)
        self.acc[self.rank].copy_(input)
        self._post()

    def _post(self) -> None:
        k = self.step
        self._exchange(self.acc[(self.rank - k) % self.size], self.acc[(self.rank - k - 1) % self.size])

    def wait(self, timeout: timedelta | None = None) -> bool:
        """``timeout`` is unused: :data:`WAIT_TIMEOUT` bounds each step."""
        _FLIGHT.wait(self.number, self.kind)
        while self.pending:
            self._complete()
            self.step += 1
            if self.step < self.size - 1:
                self._post()
        _FLIGHT.done(self.number)
        return True


# [Note: collectives in place]
# Through a packed collective, stages 1-2's reductions and gathers are a copy into a bucket-sized buffer, the
# collective, and a copy out. On a CPU the buffers cost more than the copies, since every allocation of that size is
# fresh pages the kernel must fault in and zero, and a persistent buffer would break the stage's memory formula. Each
# rank instead sends every other rank its part of each parameter, a contiguous view, and receives into views: the
# all-gather's straight into the parameters, the reduce-scatter's into one segment per peer, which the caller adds
# (``benchmarks/results/2026-11-21-gloo-rings.md``). Point-to-point transfers between two ranks are matched in posting
# order, so every rank posts the same pieces in the same order.
#
# Each transfer costs gloo a fixed overhead whatever its size, so a model of hundreds of small tensors would pay more
# for the transfers than for the bytes. Runs of adjacent pieces whose padded chunk is at most :data:`PACK_PIECE_BYTES`
# therefore travel as one transfer. The runs are decided from the padded chunk lengths, which every rank knows alike, so
# every rank posts the same number of transfers.

PACK_PIECE_BYTES = 64 * 1024


def packed_runs(chunk_numels: Sequence[int], itemsize: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start = 0
    for i, numel in enumerate(chunk_numels):
        if numel * itemsize > PACK_PIECE_BYTES:
            if start < i:
                runs.append((start, i))
            runs.append((i, i + 1))
            start = i + 1
    if start < len(chunk_numels):
        runs.append((start, len(chunk_numels)))
    return runs


class Exchange(Ring):
    """Sends ``to(peer)`` to each peer and receives ``source(peer)`` from each, nearest peers first."""

    def __init__(
        self,
        kind: str,
        to: Callable[[int], Sequence[torch.Tensor]],
        source: Callable[[int], Sequence[torch.Tensor]],
        group: dist.ProcessGroup | None,
        number: int = 0,
        chunk_numels: Sequence[int] | None = None,
    ) -> None:
        super().__init__(group, number)
        self.kind = kind
        self.unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        #: Alive until their transfers complete.
        self.sent: list[torch.Tensor] = []
        runs: list[tuple[int, int]] | None = None
        for distance in range(1, self.size):
            peer_to, peer_from = (self.rank + distance) % self.size, (self.rank - distance) % self.size
            sends, receives = to(peer_to), source(peer_from)
            if runs is None and chunk_numels is not None and sends:
                runs = packed_runs(chunk_numels, sends[0].element_size())
            # Empty pieces (a rank past a parameter's last row) travel too: every rank then issues the same number
            # of operations, which the watchdog compares across ranks to tell a diverged rank.
            for piece in self._outgoing(sends, runs):
                self.pending.append(dist.isend(piece, self._global(peer_to), group=self.group))
            for piece in self._incoming(receives, runs):
                self.pending.append(dist.irecv(piece, self._global(peer_from), group=self.group))

    def _outgoing(self, pieces: Sequence[torch.Tensor], runs: list[tuple[int, int]] | None) -> list[torch.Tensor]:
        return [pieces[a] if b - a == 1 else self._pack(pieces[a:b]) for a, b in runs] if runs else list(pieces)

    def _incoming(self, pieces: Sequence[torch.Tensor], runs: list[tuple[int, int]] | None) -> list[torch.Tensor]:
        return [pieces[a] if b - a == 1 else self._unpacked(pieces[a:b]) for a, b in runs] if runs else list(pieces)

    def _pack(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        packed = torch.cat([piece if piece.dim() == 1 else piece.reshape(-1) for piece in pieces])
        self.sent.append(packed)
        return packed

    def _unpacked(self, views: Sequence[torch.Tensor]) -> torch.Tensor:
        buffer = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device)
        self.unpack.append((buffer, list(views)))
        return buffer

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group else rank

    def wait(self, timeout: timedelta | None = None) -> bool:
        """``timeout`` is unused: :data:`WAIT_TIMEOUT` bounds each transfer."""
        _FLIGHT.wait(self.number, self.kind)
        if self.pending:
            self._complete()
        with torch.no_grad():
            for buffer, views in self.unpack:
                parts = buffer.split_with_sizes([v.numel() for v in views])
                torch._foreach_copy_(views, [p if v.dim() == 1 else p.view_as(v) for v, p in zip(views, parts)])
        self.unpack, self.sent = [], []
        _FLIGHT.done(self.number)
        return True


class MaxExchange(Exchange):
    """A small tensor's MAX all-reduce as an exchange (``collectives.max_in_place``)."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, number: int = 0) -> None:
        self.tensor = tensor
        self.received = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        super().__init__("all_reduce", lambda peer: [tensor], lambda peer: [self.received[peer]], group, number)

    def wait(self, timeout: timedelta | None = None) -> bool:
        super().wait(timeout)
        for peer, values in enumerate(self.received):
            if peer != self.rank:
                torch.maximum(self.tensor, values, out=self.tensor)
        return True
