"""One gradient bucket of stages 1-2 through a backward: filled by its parameters' gradients, reduced by one
collective, landed into this rank's rows (bucket, segment, landed: [Note: vocabulary] in ``engine/__init__.py``; the
layout: [Note: rank-major buckets] in ``layout.py``). As FSDP2's ``FSDPParamGroup`` owns its unit's reduce-scatter,
the bucket owns launching and landing its own; the reducer (``grad_sync.py``) decides when, in one order on every
rank ([Note: every rank launches buckets in the same order]).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.compression import CompressedComm
from lightning_zero.engine.row_major import gradient_form_error
from lightning_zero.engine.stage12 import buckets
from lightning_zero.engine.stage12.layout import BucketSpec, ShardLayout
from lightning_zero.engine.stage12.reduce_in_place import InPlaceReduction
from lightning_zero.engine.stage12.zero_param import GradState, ZeroParam


class Pending(Protocol):
    def wait(self) -> object: ...


class ReductionState(enum.Enum):
    """Where a bucket's reduction is in the current synchronising backward."""

    FILLING = enum.auto()
    """Its parameters' gradients are arriving (:attr:`GradBucket.ready` counts them)."""
    IN_FLIGHT = enum.auto()
    """Launched, not yet waited on."""
    LANDED = enum.auto()
    """The reduced segment is in this rank's rows; the next synchronising backward fills it again."""


@dataclasses.dataclass(frozen=True)
class BucketComm:
    """What every bucket of one reducer reduces with."""

    layout: ShardLayout
    params: Sequence[nn.Parameter]
    """The reducer's trainable parameters, in layout order."""
    rank: int
    group: dist.ProcessGroup | None
    shard_gradients: bool
    """Stage 2: this rank keeps only its segment, in :attr:`GradBucket.storage`; stage 1 keeps ``p.grad``."""
    compression: CompressedComm | None
    device: torch.device


@dataclasses.dataclass
class _Flight:
    work: Pending | None
    comm: torch.Tensor | None
    out: torch.Tensor | None
    direct: bool
    """``out`` is the storage itself (stage 2, a bucket holding no earlier sums)."""
    accumulate: bool
    """Stage 2: the storage holds earlier sums that ``out`` adds to."""
    in_place: InPlaceReduction | None = None  # a reduction without ``comm`` and ``out`` (``reduce_in_place.py``)


class GradBucket:
    """One bucket: its parameters' records, the dtype they reduce in, stage 2's segment of held sums, and its
    reduction's state."""

    def __init__(
        self,
        spec: BucketSpec,
        records: Sequence[ZeroParam],
        dtype: torch.dtype,
        comm_dtype: torch.dtype,
        comm: BucketComm,
    ) -> None:
        self.spec = spec
        self.records = list(records)
        #: Of its parameters' gradients: each bucket holds one dtype (``plan_layout(classes=...)``).
        self.dtype = dtype
        #: What it travels in, never narrower than ``dtype`` (``grad_sync.comm_dtype``).
        self.comm_dtype = comm_dtype
        self._comm = comm
        self.storage = (
            torch.zeros(spec.segment_numel, device=comm.device, dtype=dtype) if comm.shard_gradients else None
        )
        for record in self.records:
            if self.storage is not None:
                record.shard = buckets.segment_view(comm.layout, self.storage, record.index, comm.rank)
        self.state = ReductionState.FILLING
        self.ready = 0
        self._flight: _Flight | None = None

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def full(self) -> bool:
        return self.ready == len(self.records)

    def holds_sums(self) -> bool:
        """Whether its next reduction must add to sums not yet consumed."""
        return any(record.landed for record in self.records)

    def restart(self) -> None:
        """The synchronising backward ended: the next one fills it again."""
        self.state, self.ready = ReductionState.FILLING, 0

    def launch(self) -> None:
        """Start reducing its parameters' gradients (``None`` ones as zeros: every rank sends the same bytes)."""
        if self.state is not ReductionState.FILLING:
            raise RuntimeError(f"lightning_zero internal error: bucket {self.index} launched twice in one backward")
        comm, layout, spec = self._comm, self._comm.layout, self.spec
        sources: list[torch.Tensor | None] = [None] * len(comm.params)
        for record in self.records:
            sources[record.index] = grad = record.param.grad
            if grad is not None and (grad.is_sparse or grad.dtype != self.dtype):
                raise gradient_form_error(record.spec.name, grad, self.dtype)
            record.produced |= grad is not None
        self.state = ReductionState.IN_FLIGHT
        if self._reduces_in_place():
            held = comm.shard_gradients and self.holds_sums()
            reduction = InPlaceReduction(
                layout,
                self.index,
                [sources[i] for i in spec.params],
                rank=comm.rank,
                group=comm.group,
                storage=self.storage,
                held=held,
                dtype=self.dtype,
                device=comm.device,
            )
            self._flight = _Flight(None, None, None, False, held, reduction)
            return
        packed = torch.empty(spec.numel, dtype=self.comm_dtype, device=comm.device)
        buckets.pack_bucket(layout, spec, sources, packed)
        direct = accumulate = False
        if self.storage is not None:
            for record in self.records:
                record.param.grad = None
            accumulate = self.holds_sums()
            direct = not accumulate and packed.dtype == self.dtype
        if direct and self.storage is not None:
            out = self.storage
        else:
            out = torch.empty(spec.segment_numel, dtype=packed.dtype, device=packed.device)
        if comm.compression is not None:
            work = comm.compression.reduce_scatter(out, packed, comm.group, key=self.index)
        else:
            work = collectives.reduce_scatter(out, packed, group=comm.group, async_op=True)
        self._flight = _Flight(work, packed, out, direct, accumulate)

    def _reduces_in_place(self) -> bool:
        """See ``reduce_in_place.py``; every rank decides alike (same backend, settings and layout)."""
        comm = self._comm
        return comm.compression is None and self.comm_dtype == self.dtype and collectives.exchanges_in_place(comm.group)

    def land(self) -> list[tuple[torch.Tensor, Sequence[int]]]:
        """Wait for the reduction and write it into this rank's rows; every record becomes ``REDUCED`` (unless a step
        finalized it already). Returns the flat buffers stage 1's summed rows became views of, if any."""
        flight, comm = self._flight, self._comm
        if flight is None:
            raise RuntimeError(f"lightning_zero internal error: bucket {self.index} landed without a reduction")
        self._flight = None
        if flight.work is not None:
            flight.work.wait()
        flats: list[tuple[torch.Tensor, Sequence[int]]] = []
        if flight.in_place is not None:
            flight.in_place.land([record.param for record in self.records])
            flats = list(flight.in_place.flats or [])
        elif flight.out is None:
            raise RuntimeError(f"lightning_zero internal error: bucket {self.index}'s reduction has no output")
        elif self.storage is not None:
            if flight.accumulate:
                self.storage.add_(flight.out)
            elif not flight.direct:
                self.storage.copy_(flight.out)
        else:
            buckets.land_in_own_rows(comm.layout, self.index, comm.params, flight.out, comm.rank)
        for record in self.records:
            record.landed = True
            if record.state is not GradState.FINALIZED:
                record.state = GradState.REDUCED
        self.state = ReductionState.LANDED
        return flats
