"""The only module that calls ``torch.distributed`` collectives.

Every call is labelled with ``torch.profiler.record_function`` and counted in :func:`comm_stats`, so tests and
benchmarks can assert what a step communicates without patching torch. FSDP2 is routed through here too, via its custom
all-gather / reduce-scatter hooks (``fsdp2_comm.py``). Over gloo, reduce-scatter and all-gather run as point-to-point
transfers (``p2p_transport.py``) or through shared-memory mailboxes (``shm_transport.py``). What is counted is
``comm_stats.py``'s [Note: counting convention].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_zero.engine.comm import p2p_transport as p2p
from lightning_zero.engine.comm import shm_transport
from lightning_zero.engine.comm.comm_stats import CommStats
from lightning_zero.engine.comm.flight import RECORDER as _FLIGHT

ReduceOp = dist.ReduceOp
#: ``ReduceOp.SUM`` and the other members are ``RedOpType`` values.
ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType
#: torch 2.13 renamed the flat collectives (the old names now warn); earlier releases have only the old ones.
_all_gather_flat: Callable[..., dist.Work | None] = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat: Callable[..., dist.Work | None] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)
_T = TypeVar("_T")

_STATS = CommStats()


def set_wait_timeout(timeout: timedelta | None) -> None:
    """gloo applies the process group's timeout to collectives but not to isend/irecv waits, which our rings use."""
    p2p.WAIT_TIMEOUT = timeout


def comm_stats() -> CommStats:
    return _STATS


def _count(kind: str, tensor: torch.Tensor, group: dist.ProcessGroup | None, times: int = 1) -> None:
    _STATS.record(kind, tensor, group_ranks(group), times)


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    if not is_distributed():
        return (0,)
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    unit: int = 0,
) -> dist.Work | p2p.Ring | None:
    """Sum ``input`` over ranks into rank r's segment in ``output`` (may overwrite ``input``); ``unit``: the stage-3
    unit served (``flight.unit_code``)."""
    if world_size(group) == 1:
        output.copy_(input)
        return None
    number = _FLIGHT.issue("reduce_scatter", input.numel(), input.dtype, unit)
    _count("reduce_scatter", input, group)
    with record_function("lightning_zero::reduce_scatter"):
        if (mailboxes := _shared_memory(group, output, input)) is not None:
            return _through_mailboxes(
                mailboxes, mailboxes.reduce_scatter, output, input, number, "reduce_scatter", async_op
            )
        work: dist.Work | None
        if _use_ring(group):
            work = p2p.RingReduceScatter(output, input, group, number)
        else:
            work = _reduce_scatter_flat(output, input, op=ReduceOp.SUM, group=group, async_op=async_op)
        return _handed_back(work, async_op, number, "reduce_scatter")


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    unit: int = 0,
) -> dist.Work | p2p.Ring | None:
    if world_size(group) == 1:
        output.copy_(input)
        return None
    number = _FLIGHT.issue("all_gather", output.numel(), output.dtype, unit)
    _count("all_gather", output, group)
    with record_function("lightning_zero::all_gather"):
        staging = _staging_device(output, group)
        if staging is not None:  # host tensors (offloaded state) over a device-only backend
            staged = output.to(staging)
            _FLIGHT.wait(number, "all_gather")
            _all_gather_flat(staged, input.to(staging), group=group)
            _FLIGHT.done(number)
            output.copy_(staged)
            return None
        if (mailboxes := _shared_memory(group, output, input)) is not None:
            return _through_mailboxes(mailboxes, mailboxes.all_gather, output, input, number, "all_gather", async_op)
        work: dist.Work | None
        if _use_ring(group):
            work = p2p.RingAllGather(output, input, group, number)
        else:
            work = _all_gather_flat(output, input, group=group, async_op=async_op)
        return _handed_back(work, async_op, number, "all_gather")


_PACKED_ONLY = False


def exchanges_in_place(group: dist.ProcessGroup | None = None) -> bool:
    """[Note: collectives in place] (``p2p_transport.py``) needs gloo's point-to-point transfers; mailboxes and other
    backends take packed buffers."""
    return not _PACKED_ONLY and world_size(group) > 1 and _use_ring(group) and shm_transport.for_group(group) is None


@contextlib.contextmanager
def packed_only() -> Iterator[None]:
    """Stages 1-2 reduce and gather through packed buffers inside (``bench_collectives.py`` compares the two ways)."""
    global _PACKED_ONLY
    previous, _PACKED_ONLY = _PACKED_ONLY, True
    try:
        yield
    finally:
        _PACKED_ONLY = previous


def all_gather_in_place(
    pieces: Sequence[Sequence[torch.Tensor]],
    packed_numel: int,
    group: dist.ProcessGroup | None = None,
    chunk_numels: Sequence[int] | None = None,
) -> p2p.Ring:
    """Every rank's ``pieces[rank]`` into ``pieces[rank]`` of every other rank, with no bucket buffer (see
    [Note: collectives in place] in ``p2p_transport.py``). ``packed_numel`` is counted, as the packed collective's
    buffer; ``chunk_numels`` lets small pieces travel together."""
    mine = pieces[rank(group)]
    return _exchange_counted(
        "all_gather", mine, packed_numel, group, lambda peer: mine, lambda peer: pieces[peer], chunk_numels
    )


def reduce_scatter_in_place(
    sends: Sequence[Sequence[torch.Tensor]],
    receives: Sequence[Sequence[torch.Tensor]],
    packed_numel: int,
    group: dist.ProcessGroup | None = None,
    chunk_numels: Sequence[int] | None = None,
) -> p2p.Ring:
    """The transfers of a reduce-scatter without its buffers (see [Note: collectives in place] in
    ``p2p_transport.py``): ``sends[r]`` lands in rank r's ``receives[this rank]``, and the caller adds what it received
    once the handle is waited on."""
    mine = [piece for pieces in sends for piece in pieces]
    return _exchange_counted(
        "reduce_scatter", mine, packed_numel, group, lambda peer: sends[peer], lambda peer: receives[peer], chunk_numels
    )


def _exchange_counted(
    kind: str,
    like: Sequence[torch.Tensor],
    packed_numel: int,
    group: dist.ProcessGroup | None,
    to: Callable[[int], Sequence[torch.Tensor]],
    source: Callable[[int], Sequence[torch.Tensor]],
    chunk_numels: Sequence[int] | None = None,
) -> p2p.Ring:
    dtype = like[0].dtype if like else torch.float32
    number = _FLIGHT.issue(kind, packed_numel, dtype)
    _STATS.record_elements(kind, packed_numel, dtype.itemsize, group_ranks(group))
    with record_function(f"lightning_zero::{kind}"):
        return p2p.Exchange(kind, to, source, group, number, chunk_numels)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    unit: int = 0,
) -> dist.Work | None:
    """Rank r's chunk j of ``input`` lands as chunk r of rank j's ``output`` (compressed gradient reduction)."""
    if world_size(group) == 1:
        output.copy_(input)
        return None
    number = _FLIGHT.issue("all_to_all", input.numel(), input.dtype, unit)
    _count("all_to_all", input, group)
    with record_function("lightning_zero::all_to_all"):
        work = dist.all_to_all_single(output, input, group=group, async_op=True)
        if async_op and work is not None:  # torch 2.14's stub types an async call's Work as optional
            return _Tracked(work, number, "all_to_all")
        finish(work, number, "all_to_all")
        return None


class _Tracked(dist.Work):
    """Reports its wait to the flight recorder, as our rings do."""

    def __init__(self, work: dist.Work, number: int, kind: str) -> None:
        super().__init__()
        self.work, self.number, self.kind = work, number, kind

    def wait(self, timeout: timedelta | None = None) -> bool:
        finish(self.work, self.number, self.kind)
        return True


def _handed_back(work: dist.Work | None, async_op: bool, number: int, kind: str) -> dist.Work | None:
    if async_op:
        return work
    finish(work, number, kind)
    return None


def finish(work: dist.Work | None, number: int = 0, kind: str = "") -> None:
    if isinstance(work, p2p.Ring):
        work.wait()  # records its own wait
    elif work is not None:
        _FLIGHT.wait(number, kind)
        with record_function("lightning_zero::wait"):
            work.wait()
        _FLIGHT.done(number)
    return None


def _use_ring(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def _shared_memory(
    group: dist.ProcessGroup | None, output: torch.Tensor, input: torch.Tensor
) -> shm_transport.SharedMemoryGroup | None:
    """Every rank decides alike (same backend, devices and layout)."""
    if not (
        _use_ring(group)
        and output.device.type == "cpu"
        and input.device.type == "cpu"
        and output.is_contiguous()
        and input.is_contiguous()
        and output.dtype == input.dtype
    ):
        return None
    return shm_transport.for_group(group)


def _through_mailboxes(
    mailboxes: shm_transport.SharedMemoryGroup,
    collective: Callable[[torch.Tensor, torch.Tensor], None],
    output: torch.Tensor,
    input: torch.Tensor,
    number: int,
    kind: str,
    async_op: bool,
) -> dist.Work | None:
    work = mailboxes.submit(collective, output, input)
    if work is None:
        _FLIGHT.wait(number, kind)
        _FLIGHT.done(number)
        return None
    if async_op:
        return _Tracked(work, number, kind)
    finish(work, number, kind)
    return None


def all_reduce(
    tensor: torch.Tensor, op: ReduceOpLike = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    if world_size(group) == 1:
        return tensor
    number = _FLIGHT.issue("all_reduce", tensor.numel(), tensor.dtype)
    _count("all_reduce", tensor, group, times=2)
    with record_function("lightning_zero::all_reduce"):
        staging = _staging_device(tensor, group)
        _FLIGHT.wait(number, "all_reduce")
        if staging is None:
            dist.all_reduce(tensor, op=op, group=group)
        else:
            staged = tensor.to(staging)
            dist.all_reduce(staged, op=op, group=group)
            tensor.copy_(staged)
        _FLIGHT.done(number)
    return tensor


def max_in_place(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> p2p.Ring:
    """A started MAX all-reduce as an exchange, recorded and counted as the all-reduce it replaces."""
    number = _FLIGHT.issue("all_reduce", tensor.numel(), tensor.dtype)
    _count("all_reduce", tensor, group, times=2)
    with record_function("lightning_zero::all_reduce"):
        return p2p.MaxExchange(tensor, group, number)


def _staging_device(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.device | None:
    """NCCL moves only CUDA tensors: offloaded host tensors go through the current CUDA device."""
    if tensor.device.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def broadcast(tensors: Sequence[torch.Tensor], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    if world_size(group) == 1:
        return
    number = _FLIGHT.issue("broadcast", sum(t.numel() for t in tensors), tensors[0].dtype if tensors else None)
    with record_function("lightning_zero::broadcast"):
        works = []
        for tensor in tensors:
            _count("broadcast", tensor, group)
            works.append(dist.broadcast(tensor, src=src, group=group, async_op=True))
        _FLIGHT.wait(number, "broadcast")
        for work in works:
            if work is not None:  # as in all_to_all
                work.wait()
        _FLIGHT.done(number)


def broadcast_object(obj: _T, src: int = 0, group: dist.ProcessGroup | None = None) -> _T:
    holder = [obj]
    if world_size(group) > 1:
        _pickled("broadcast_object", lambda: dist.broadcast_object_list(holder, src=src, group=group))
    return holder[0]


def _blocking(kind: str, numel: int = 0, dtype: torch.dtype | None = None) -> int:
    number = _FLIGHT.issue(kind, numel, dtype)
    _FLIGHT.wait(number, kind)
    return number


def _pickled(kind: str, call: Callable[[], object]) -> None:
    number = _blocking(kind)
    with record_function(f"lightning_zero::{kind}"):
        call()
    _FLIGHT.done(number)


def all_gather_objects(obj: _T, group: dist.ProcessGroup | None = None) -> list[_T]:
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    _pickled("all_gather_object", lambda: dist.all_gather_object(out, obj, group=group))
    return out


def gather_objects(obj: _T, dst: int = 0) -> list[_T] | None:
    if world_size() == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == dst else None
    _pickled("gather_object", lambda: dist.gather_object(obj, out, dst=dst))
    return out


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if world_size(group) > 1:
        _pickled("barrier", lambda: dist.barrier(group=group))


def reduce_scatter_op(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOpLike,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    unit: int = 0,
) -> dist.Work | None:
    """A reduce-scatter with any op, by the backend itself (FSDP2's fp16 pre/post-divide and async paths)."""
    number = _FLIGHT.issue("reduce_scatter", input.numel(), input.dtype, unit)
    _count("reduce_scatter", input, group)
    with record_function("lightning_zero::reduce_scatter"):
        if async_op:
            return _reduce_scatter_flat(output, input, op=op, group=group, async_op=True)
        _FLIGHT.wait(number, "reduce_scatter")
        _reduce_scatter_flat(output, input, op=op, group=group)
        _FLIGHT.done(number)
        return None


def record_sent(tensor: torch.Tensor) -> None:
    """Count a point-to-point send of ``torch.distributed.pipelining``."""
    _count("send", tensor, None)


def all_gather_uncounted(tensor: torch.Tensor) -> torch.Tensor:
    """For bookkeeping (the monitor's figures) that must not show up in the model's communication counts."""
    if world_size() == 1:
        return tensor.unsqueeze(0)
    out = torch.empty(world_size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    number = _blocking("all_gather_uncounted", out.numel(), out.dtype)
    _all_gather_flat(out, tensor.contiguous())
    _FLIGHT.done(number)
    return out.view(world_size(), *tensor.shape)
