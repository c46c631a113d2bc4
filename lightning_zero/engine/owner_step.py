"""Whole-parameter steps for optimizers that are not element-wise (Muon, Adafactor), at every stage.

[Note: owner stepping]
Newton-Schulz orthogonalisation (Muon) and factored row/column statistics (Adafactor) need the whole parameter, so the
usual ZeRO step on dim-0 rows would compute something else. Each such parameter instead gets an owner rank, chosen once
from the parameters' full shapes (never a stage-3 shard's shape) by longest-processing-time-first on elements, so
optimizer state and the owners' work are spread about evenly. A step then:

1. sends every rank's rows of each whole parameter's reduced gradient to its owner, and, where the truth lives apart
   from a full copy (fp32 masters, host copies, stage 3's shards), the parameter's rows too, one all-to-all each;
2. the owner steps its whole tensor, which the optimizer keys its state by, so that state exists only on the owner;
3. sends each rank its rows of the updated parameter back (one all-to-all); the engine's own post-step gather (stages
   1-2) or FSDP2's next all-gather (stage 3) does the rest.

Other ranks leave the parameter out of the optimizer's groups for the step, so the optimizer creates no state for it
there. Stages 1-2 in full precision already hold whole parameters, so the owner's whole tensor is the resident parameter
itself and step 1 sends gradients only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shard import chunk_numel, element_range


def plan_owners(shapes: Mapping[int, torch.Size], world_size: int, load: list[int] | None = None) -> dict[int, int]:
    """Key -> owner rank. Ties go to the lower key and rank, so every rank computes the same plan."""
    load = list(load) if load is not None else [0] * world_size
    owners = {}
    for key in sorted(shapes, key=lambda k: (-math.prod(shapes[k]), k)):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        owners[key] = owner
        load[owner] += math.prod(shapes[key])
    return owners


class OwnerStepping:
    """The whole parameters of one optimizer (see [Note: owner stepping]), keyed by the engine's parameter indices."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        comm_device: torch.device,
        dtype: torch.dtype = torch.float32,
        resident: bool = False,
    ) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.comm_device, self.dtype = comm_device, dtype
        #: The owners' whole tensors alias the truth, so a step gathers gradients only. The same on every rank: it
        #: decides which collectives run.
        self.resident = resident
        self.owner: dict[int, int] = {}
        self.shapes: dict[int, torch.Size] = {}
        #: This rank's keys only; the optimizer keys its state by them.
        self.whole: dict[int, torch.Tensor] = {}
        self.on_host = False
        #: Between :meth:`gather` and :meth:`scatter`.
        self.grads: dict[int, torch.Tensor] = {}
        self.load = [0] * world_size

    def adopt(self, shapes: Mapping[int, torch.Size], make_whole: Callable[[int], torch.Tensor]) -> None:
        """Plans made earlier stay: the optimizer state is keyed by them."""
        new = {key: torch.Size(shape) for key, shape in shapes.items() if key not in self.owner}
        if not new:
            return
        for key, owner in plan_owners(new, self.world_size, self.load).items():
            self.owner[key], self.shapes[key] = owner, new[key]
            self.load[owner] += math.prod(new[key])
            if owner == self.rank:
                self.whole[key] = make_whole(key)

    def rekey(self, index: Mapping[int, int]) -> OwnerStepping:
        """After the engine re-planned its layout around parameters unfrozen during ``fit``."""
        _rekey(self.owner, index)
        _rekey(self.shapes, index)
        _rekey(self.whole, index)
        return self

    def holds_on_host(self, tensor: torch.Tensor) -> bool:
        return self.on_host and any(whole is tensor for whole in self.whole.values())

    def imbalance(self) -> float:
        mean = sum(self.load) / self.world_size
        return max(self.load) / mean if mean else 1.0

    # ------------------------------------------------------------------ a step's communication
    def gather(
        self, keys: Iterable[int], rows: Callable[[int], torch.Tensor], grads: Callable[[int], torch.Tensor | None]
    ) -> None:
        """Collective: each owner receives every rank's gradient rows of the ``keys`` it owns and, unless
        :attr:`resident`, the parameter rows."""
        keys = sorted(keys)
        received = self._to_owners(keys, grads, flag=True)
        if not self.resident:
            with torch.no_grad():
                for key, value in self._to_owners(keys, rows, flag=False).items():
                    if value is not None:
                        self.whole[key].copy_(value)
        self.grads = {
            key: value.to(self.whole[key].device, self.whole[key].dtype)
            for key, value in received.items()
            if value is not None
        }

    def scatter(self, keys: Iterable[int], write: Callable[[int, torch.Tensor], None]) -> None:
        """Collective: every rank receives its rows of the updated whole parameters of ``keys``."""
        keys = sorted(keys)
        self.grads = {}
        world, segment, offsets = self.world_size, *self._segments(keys, flag=False)
        send = torch.zeros(world * segment, dtype=self.dtype, device=self.comm_device)
        lanes = send.view(world, segment)
        for key in keys:
            if self.owner[key] != self.rank:
                continue
            chunk = chunk_numel(self.shapes[key], world)
            padded = torch.zeros(world * chunk, dtype=send.dtype, device=send.device)
            padded[: self.whole[key].numel()].copy_(self.whole[key].reshape(-1))
            lanes[:, offsets[key] : offsets[key] + chunk].copy_(padded.view(world, chunk))
        received = torch.empty_like(send)
        collectives.all_to_all(received, send, group=self.group)
        lanes = received.view(world, segment)
        for key in keys:
            start, end = element_range(self.shapes[key], self.rank, world)
            write(key, lanes[self.owner[key], offsets[key] : offsets[key] + end - start])

    # ------------------------------------------------------------------ packing
    def _segments(self, keys: list[int], flag: bool) -> tuple[int, dict[int, int]]:
        """``flag``: one more element per key saying whether the sender had anything for it, so a parameter no rank had
        a gradient for stays without one."""
        offsets, used = {}, [0] * self.world_size
        for key in keys:
            owner = self.owner[key]
            offsets[key] = used[owner]
            used[owner] += chunk_numel(self.shapes[key], self.world_size) + int(flag)
        return max(used), offsets

    def _to_owners(
        self, keys: list[int], read: Callable[[int], torch.Tensor | None], flag: bool
    ) -> dict[int, torch.Tensor | None]:
        world = self.world_size
        segment, offsets = self._segments(keys, flag)
        send = torch.zeros(world * segment, dtype=self.dtype, device=self.comm_device)
        lanes = send.view(world, segment)
        for key in keys:
            rows = read(key)
            if rows is None:
                continue
            lane, offset = lanes[self.owner[key]], offsets[key]
            lane[offset : offset + rows.numel()].copy_(rows.reshape(-1))
            if flag:
                lane[offset + chunk_numel(self.shapes[key], world)] = 1
        received = torch.empty_like(send)
        collectives.all_to_all(received, send, group=self.group)
        lanes = received.view(world, segment)
        out: dict[int, torch.Tensor | None] = {}
        for key in keys:
            if self.owner[key] != self.rank:
                continue
            chunk, offset = chunk_numel(self.shapes[key], world), offsets[key]
            if flag and not bool(lanes[:, offset + chunk].any()):
                out[key] = None
                continue
            out[key] = (
                lanes[:, offset : offset + chunk].reshape(-1)[: math.prod(self.shapes[key])].view(self.shapes[key])
            )
        return out


V = TypeVar("V")


def _rekey(table: dict[int, V], index: Mapping[int, int]) -> None:
    moved = {index[key]: value for key, value in table.items()}
    table.clear()
    table.update(moved)
