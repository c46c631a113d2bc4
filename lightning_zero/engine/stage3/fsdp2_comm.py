"""FSDP2's collectives, routed through ``collectives.py`` so stage 3 is counted, labelled, watched and compressed
(``compression.py``) like stages 1-2 (``fully_shard`` modules take them via ``set_custom_all_gather`` /
``set_custom_reduce_scatter``, and hybrid sharding's sum across replicas via ``set_all_reduce_hook``).

[Note: reduce-scatters that land after backward]
FSDP2 overlaps a unit's gradient reduce-scatter with the next unit's backward by running it on a CUDA stream. A CPU has
no streams, so FSDP2's reduce-scatter would return only when the reduction is done, with the training thread waiting for
it (``benchmarks/results/2026-11-26-cpu-step-time.md``). Here it is posted and returns at once; it lands (the sum, then
FSDP2's average) when backward ends, in an autograd final callback queued behind FSDP2's own, or earlier when more than
:data:`MAX_IN_FLIGHT` are posted. Until then FSDP2 has only made views of the output as the sharded gradients, which
nobody reads during backward, unless FSDP2 itself reads the output right away: it adds it to gradients already there,
casts it, copies it to the host, divides it after a SUM, or hands it to post-accumulate-grad hooks or an all-reduce
hook. Each of those is checked per call, and that reduce-scatter completes at once. A unit run several times in one
forward is reduced once per run: its earlier reductions land before the next, which FSDP2 adds to them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lightning_zero.engine.comm import collectives, flight
from lightning_zero.engine.comm.collectives import ReduceOp, ReduceOpLike
from lightning_zero.engine.comm.compression import CompressedComm
from lightning_zero.engine.stage3.fsdp2_private import AllGather, ReduceScatter, sharded_params
from lightning_zero.torch_versions.autograd import queue_callback


class CountingAllGather(AllGather):
    """FSDP2's all-gather, recorded with its ``unit`` (see [Note: operation numbers and the running hash])."""

    def __init__(self, compression: CompressedComm | None = None, unit: int = 0) -> None:
        self.compression, self.unit = compression, unit

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        # FSDP2 gathers a unit in uint8 when its parameters' dtypes differ: such bytes travel as they are.
        if self.compression is not None and self.compression.compresses_params(output_tensor.dtype):
            self.compression.all_gather(output_tensor, input_tensor, group, async_op=False, unit=self.unit)
            return None
        # FSDP2 only waits on a real `dist.Work`; complete ring gathers before returning.
        work = collectives.all_gather(output_tensor, input_tensor, group=group, async_op=async_op, unit=self.unit)
        if isinstance(work, dist.Work):
            return work
        collectives.finish(work)
        return None


class CountingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter; ``key`` names the unit and its error-feedback residuals. With ``landing``,
    see [Note: reduce-scatters that land after backward]."""

    def __init__(
        self,
        compression: CompressedComm | None = None,
        key: str = "",
        unit: FSDPModule | None = None,
        landing: "LateReductions | None" = None,
        finished: "FinishedUnits | None" = None,
        position: int = 0,
        alone: bool = False,
    ) -> None:
        self.compression, self.key, self.code = compression, key, flight.unit_code(key)
        self.unit, self.landing = unit, landing
        self.finished, self.position = finished, position
        #: See [Note: units finished alone].
        self.alone = alone

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.alone and self.finished is not None:
            self.finished.allocated(self.position)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: ReduceOpLike,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self.finished is not None:
            self.finished.announce()  # the units reduced before this one have their gradients now
        if self.landing is not None:  # a unit run twice in forward: FSDP2 adds the second reduction to the first
            self.landing.land_through(self)
        # FSDP2 asks for AVG in fp32/bf16 (SUM, then a divide, is the same arithmetic) and SUM otherwise.
        if op in (ReduceOp.SUM, ReduceOp.AVG) and not async_op:
            if self.compression is not None:
                self.compression.reduce_scatter(
                    output_tensor, input_tensor, group, self.key, async_op=False, unit=self.code
                )
            elif op == ReduceOp.AVG and self.landing is not None and self._unread(output_tensor):
                work = collectives.reduce_scatter(
                    output_tensor, input_tensor, group=group, async_op=True, unit=self.code
                )
                reduced = self.finished.reduced(self.position, landed=False) if self.finished is not None else None
                self.landing.add(work, output_tensor, collectives.world_size(group), reduced, owner=self)
                if self.finished is not None:
                    self.finished.announce()  # adding may have landed earlier units' reductions
                return None
            else:
                collectives.reduce_scatter(output_tensor, input_tensor, group=group, unit=self.code)
            if op == ReduceOp.AVG:
                output_tensor.div_(collectives.world_size(group))
            if self.finished is not None:
                self.finished.reduced(self.position, landed=True)
            return None
        if self.finished is not None:
            self.finished.reduced(self.position, landed=not async_op)
        return collectives.reduce_scatter_op(
            output_tensor, input_tensor, op, group=group, async_op=async_op, unit=self.code
        )

    def _unread(self, output: torch.Tensor) -> bool:
        """Whether FSDP2 only views ``output`` as the unit's new sharded gradients, so it may land after backward."""
        if self.unit is None:
            raise RuntimeError("lightning_zero internal error: the engine gives ``landing`` together with its unit")
        for param, offloaded in sharded_params(self.unit):
            if (
                param.grad is not None
                or param.dtype != output.dtype
                or (offloaded and output.device.type != "cpu")
                or getattr(param, "_post_accumulate_grad_hooks", None)
            ):
                return False
        return True


#: Reduce-scatters posted and not yet landed, at most; two keep the link busy while bounding their buffers.
MAX_IN_FLIGHT = 2


@dataclasses.dataclass
class _Reduced:
    position: int
    landed: bool


class FinishedUnits:
    """The units whose gradients FSDP2 has finished during a backward, told to a listener in the order they were reduced
    (see [Note: the host step during backward] in ``engine/offload/schedule.py``). FSDP2 makes a unit's gradients of its
    reduce-scatter's output after the collective returns, so a unit is finished only when the next reduce-scatter
    begins, when backward ends, or when its late reduction has landed. On an accelerator the listener runs on FSDP2's
    reduce-scatter stream, behind the finished unit's work there.

    [Note: units finished alone]
    With one rank in the shard group FSDP2 never calls the reduce-scatter: it copies each unit's gradients into the
    output instead. It still asks the reduce-scatter to allocate the input, then, on its reduce-scatter stream, the
    output, so the output's allocation stands for the call that does not come: the units before have their gradients
    then, and this one has them by the next allocation or when backward ends."""

    def __init__(self) -> None:
        self._listener: Callable[[int], None] | None = None
        self._queue: deque[_Reduced] = deque()
        self._inputs: set[int] = set()  # alone: input allocated, output not yet

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def listen(self, listener: Callable[[int], None]) -> None:
        self._listener, self._queue, self._inputs = listener, deque(), set()

    def allocated(self, position: int) -> None:
        """See [Note: units finished alone]."""
        if self._listener is None:
            return
        if position not in self._inputs:
            self._inputs.add(position)
            return
        self._inputs.discard(position)
        self.announce()
        self.reduced(position, landed=True)

    def reduced(self, position: int, landed: bool) -> _Reduced:
        entry = _Reduced(position, landed)
        if self._listener is not None:
            self._queue.append(entry)
        return entry

    def announce(self) -> None:
        """A later unit waits for the earlier ones: reductions land in order."""
        while self._queue and self._queue[0].landed and self._listener is not None:
            self._listener(self._queue.popleft().position)

    def finish(self) -> None:
        self.announce()
        self._listener, self._queue, self._inputs = None, deque(), set()


class LateReductions:
    """Landed in posting order, the same on every rank: see [Note: reduce-scatters that land after backward]."""

    def __init__(self) -> None:
        self._pending: deque[tuple[dist.Work | None, torch.Tensor, int, _Reduced | None]] = deque()
        self._owners: deque[object] = deque()
        self._callback_queued = False

    def add(
        self,
        work: dist.Work | None,
        output: torch.Tensor,
        divide: int,
        reduced: _Reduced | None = None,
        owner: object = None,
    ) -> None:
        self._pending.append((work, output, divide, reduced))
        self._owners.append(owner)
        if not self._callback_queued:
            try:
                queue_callback(self.land_all)
                self._callback_queued = True
            except RuntimeError:  # not inside a backward pass: nothing would land it
                self.land_all()
                return
        while len(self._pending) > MAX_IN_FLIGHT:
            self._land_first()

    def land_through(self, owner: object) -> None:
        """FSDP2 is about to add to the output of ``owner``'s reductions."""
        while owner in self._owners:
            self._land_first()

    def land_all(self) -> None:
        self._callback_queued = False
        while self._pending:
            self._land_first()

    def _land_first(self) -> None:
        self._owners.popleft()
        self._land(*self._pending.popleft())

    @staticmethod
    def _land(work: dist.Work | None, output: torch.Tensor, divide: int, reduced: _Reduced | None) -> None:
        collectives.finish(work)
        output.div_(divide)
        if reduced is not None:
            reduced.landed = True


class SumOverReplicas:
    """FSDP2's all-reduce hook under hybrid sharding (see [Note: stage 3 hybrid sharding and hpZ])."""

    def __init__(self, group: dist.ProcessGroup, compression: CompressedComm | None = None, key: str = "") -> None:
        self.group, self.compression, self.key = group, compression, key

    def __call__(self, reduced: torch.Tensor) -> None:
        if self.compression is not None:
            self.compression.sum_over(reduced, self.group, self.key)
        else:
            collectives.all_reduce(reduced, group=self.group)
