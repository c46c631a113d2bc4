"""The dtype the optimizer's state is held in between steps (``ZeroStrategy(optimizer_state_dtype=...)``).

[Note: bf16 optimizer states]
Adam's two moments are 8 of the 16 bytes a parameter costs under mixed precision, and on the host they are 16 of the
28 bytes its step moves per element. ``optimizer_state_dtype="bf16"`` holds every state tensor shaped like its
parameter (Adam's moments, SGD's momentum, Adagrad's sum...) in bf16 between steps; the masters stay fp32. A step
widens a *tile* of the state to the masters' dtype, runs the user's optimizer on it unchanged (torch's own kernels,
fused on the host), and rounds the result back to bf16 once, to nearest even: the arithmetic of the fp32 step on
moments that are rounded to bf16 after every step, which is what ``tests`` compare against (a plain torch optimizer
whose moments are rounded after each step). Inexact by design: the rounding error of a moment is ~2^-9 of it.

A tile is at most :data:`TILE_ELEMENTS` elements, so the fp32 copy alive during a step is a few MiB whatever the model;
a parameter larger than a tile is stepped as flat slices of itself, each with a copy of its step count (every slice
advances it alike). Stepping a few elements at a time is exact for torch's element-wise optimizers
(``optimizers.steps_in_parts``); an optimizer with step hooks, or one stepping whole matrices, is widened whole, into
a buffer freed after its step: bf16 state saves its memory between steps, and its step peaks at the fp32 state's size.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.engine.optimizers import steps_in_parts

#: ``ZeroStrategy(optimizer_state_dtype=...)`` -> the dtype held between steps (None: the optimizer's own).
STATE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
#: Elements of state widened at once: Adam's fp32 moments of one tile are 32 MiB.
TILE_ELEMENTS = 2**22
#: State tensors per element whose widening buffer is kept from step to step (Adam's 2, with room); a larger need
#: (a whole model widened at once) gets a buffer for that step only.
KEPT_SCRATCH_PER_TILE = 4


def is_state_of(name: str, value: object, key: torch.Tensor) -> bool:
    """Whether ``value`` is a per-element state tensor of the tensor ``key`` the optimizer steps (not a step count; a
    0-dim parameter's state cannot be told from scalar state such as NAdam's ``mu_product``, and stays as made)."""
    return (
        name != "step"
        and isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dim() > 0
        and value.shape == key.shape
    )


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of a stepped tensor, flattened; ``whole``: the tensor itself."""

    key: torch.Tensor
    start: int
    end: int
    whole: bool

    @property
    def numel(self) -> int:
        return self.end - self.start

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.whole else tensor.view(-1)[self.start : self.end]


class StateDtype:
    """Holds one optimizer's per-element state in :attr:`held` between steps (see [Note: bf16 optimizer states])."""

    def __init__(self, name: str = "fp32", tile_elements: int = TILE_ELEMENTS) -> None:
        self.name = name
        #: None: as the optimizer makes it (the dtype of the tensor it steps).
        self.held = STATE_DTYPES[name]
        self.tile_elements = tile_elements
        #: (thread, device, dtype) -> the buffer a tile's state is widened into, reused by every tile: a fresh
        #: allocation per tile would fault its pages in again, and on the host that costs more than the step.
        self._scratch: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def held_for(self, key: torch.Tensor) -> torch.dtype:
        """bf16 narrows fp32 and fp64 state; a bf16 parameter's state is bf16 already."""
        if self.held is None or key.dtype.itemsize <= self.held.itemsize:
            return key.dtype
        return self.held

    def step(self, optimizer: Optimizer, **kwargs: Any) -> object:
        """``optimizer.step(**kwargs)`` on the tensors now in its groups (stand-ins, ``optimizers.hosted_params``)."""
        if self.held is None:
            return optimizer.step(**kwargs)
        groups = optimizer.param_groups
        saved = [group["params"] for group in groups]
        result = None
        #: The state of each sliced tensor as the step found it: every slice starts from it, not from the step count
        #: an earlier slice advanced or the tensor it rounded its own elements into.
        before: dict[int, dict[str, Any] | None] = {}
        try:
            for tile in self._tiles(optimizer):
                standins: list[list[torch.Tensor]] = [[] for _ in groups]
                widened = []
                needs = widening_needs(tile, optimizer.state)
                scratch = _Scratch(self._scratch, needs, kept_up_to=KEPT_SCRATCH_PER_TILE * self.tile_elements)
                for position, piece in tile:
                    standin, held = self._widen(optimizer, piece, before, scratch)
                    standins[position].append(standin)
                    widened.append((piece, standin, held))
                for group, params in zip(groups, standins):
                    group["params"] = params
                try:
                    result = optimizer.step(**kwargs)
                finally:
                    for piece, standin, held in widened:
                        self._narrow(optimizer, piece, standin, held)
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        return result

    def conform(self, optimizer: Optimizer) -> None:
        """After a checkpoint wrote the state (saved in either dtype): hold it as this run does."""
        with torch.no_grad():
            for key, entry in optimizer.state.items():
                if not isinstance(key, torch.Tensor) or not key.is_floating_point():
                    continue
                dtype = self.held_for(key)
                for name, value in entry.items():
                    if is_state_of(name, value, key) and value.dtype != dtype:
                        entry[name] = value.to(dtype)

    # ------------------------------------------------------------------ tiles
    def _tiles(self, optimizer: Optimizer) -> Iterator[list[tuple[int, Piece]]]:
        """Runs of (group position, piece) of at most :attr:`tile_elements`, in ``param_groups`` order; one run of
        every tensor, whole, where stepping in parts would change the step."""
        stepped = [
            (position, p)
            for position, group in enumerate(optimizer.param_groups)
            for p in group["params"]
            if p.grad is not None
        ]
        if not steps_in_parts(optimizer):
            yield [(position, Piece(p, 0, p.numel(), True)) for position, p in stepped]
            return
        tile: list[tuple[int, Piece]] = []
        filled = 0
        for position, p in stepped:
            for piece in self._pieces(p):
                if tile and filled + piece.numel > self.tile_elements:
                    yield tile
                    tile, filled = [], 0
                tile.append((position, piece))
                filled += piece.numel
        if tile:
            yield tile

    def _pieces(self, p: torch.Tensor) -> Iterator[Piece]:
        total, size = p.numel(), self.tile_elements
        sliceable = (
            total > size
            and not isinstance(p, DTensor)
            and p.is_contiguous()
            and p.grad is not None
            and p.grad.is_contiguous()
        )
        if not sliceable:
            yield Piece(p, 0, total, True)
            return
        for start in range(0, total, size):
            yield Piece(p, start, min(start + size, total), False)

    # ------------------------------------------------------------------ widening and narrowing
    @torch.no_grad()
    def _widen(
        self, optimizer: Optimizer, piece: Piece, before: dict[int, dict[str, Any] | None], scratch: _Scratch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The tensor the optimizer steps for ``piece``, its state in the stepped tensor's dtype, and the held tensors
        a whole piece's state is rounded back into (no allocation per step: host state stays where it was first
        touched)."""
        key, entry = piece.key, optimizer.state.get(piece.key, {})
        held: dict[str, torch.Tensor] = {}
        if piece.whole:
            for name, value in entry.items():
                if is_state_of(name, value, key) and value.dtype != key.dtype:
                    held[name] = value
                    entry[name] = scratch.widened(value, key.dtype)
            return key, held
        standin = piece.of(key)
        standin.grad = piece.of(cast(torch.Tensor, key.grad))  # a sliced tensor has one (`_pieces`)
        if id(key) not in before:  # its first slice this step: None where the tensor had no state yet
            before[id(key)] = dict(entry) if entry else None
        found = before[id(key)]
        if found is not None:
            optimizer.state[standin] = {
                name: (
                    scratch.widened(piece.of(value), key.dtype)
                    if is_state_of(name, value, key)
                    else value.clone()
                    if isinstance(value, torch.Tensor)
                    else value
                )
                for name, value in found.items()
            }
        return standin, held

    @torch.no_grad()
    def _narrow(self, optimizer: Optimizer, piece: Piece, standin: torch.Tensor, held: dict[str, torch.Tensor]) -> None:
        key = piece.key
        dtype = self.held_for(key)
        if piece.whole:
            entry = optimizer.state.get(key, {})
            for name, value in entry.items():
                if not is_state_of(name, value, key) or value.dtype == dtype:
                    continue
                kept = held.get(name)
                if kept is not None and kept.dtype == dtype and kept is not value:
                    kept.copy_(value)
                    entry[name] = kept
                else:
                    entry[name] = value.to(dtype)
            return
        standin.grad = None
        stepped = optimizer.state.pop(standin, None)
        if not stepped:
            return
        entry = optimizer.state[key]  # a defaultdict: made on the first step
        for name, value in stepped.items():
            if is_state_of(name, value, standin):
                kept = entry.get(name)
                if not (isinstance(kept, torch.Tensor) and kept.shape == key.shape and kept.dtype == dtype):
                    kept = entry[name] = torch.empty(key.shape, dtype=dtype, device=key.device)
                piece.of(kept).copy_(value)
            else:
                entry[name] = value  # the step count, as every slice advanced it


class _Scratch:
    """One tile's share of the reused buffers: each widened tensor is the next run of elements of its thread's buffer
    for its device and dtype, which holds what the tile needs (a DTensor's state gets a tensor of its own)."""

    def __init__(
        self,
        buffers: dict[tuple[int, torch.device, torch.dtype], torch.Tensor],
        need: dict[tuple[torch.device, torch.dtype], int],
        kept_up_to: int,
    ) -> None:
        thread = threading.get_ident()
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        for (device, dtype), n in need.items():
            buffer = buffers.get((thread, device, dtype))
            if n > kept_up_to:  # this step's only: kept, it would hold the fp32 state bf16 was to save
                buffer = torch.empty(n, dtype=dtype, device=device)
            elif buffer is None or buffer.numel() < n:
                buffer = buffers[(thread, device, dtype)] = torch.empty(n, dtype=dtype, device=device)
            self.buffers[(device, dtype)] = buffer
        self.used: dict[tuple[torch.device, torch.dtype], int] = {}

    def widened(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n, slot = value.numel(), (value.device, dtype)
        start = self.used.get(slot, 0)
        buffer = self.buffers.get(slot)
        if isinstance(value, DTensor) or buffer is None or buffer.numel() < start + n:
            return value.to(dtype, copy=True)
        self.used[slot] = start + n
        wide = buffer[start : start + n].view(value.shape)
        wide.copy_(value)
        return wide


def widening_needs(tile: list[tuple[int, Piece]], state: Any) -> dict[tuple[torch.device, torch.dtype], int]:
    """(device, dtype) -> elements the tile's state widens into: each piece's size for each of its tensor's state
    tensors held narrower than the tensor (none before its first step)."""
    need: dict[tuple[torch.device, torch.dtype], int] = {}
    for _, piece in tile:
        key = piece.key
        if isinstance(key, DTensor):
            continue
        for name, value in state.get(key, {}).items():
            if is_state_of(name, value, key) and value.dtype != key.dtype:
                slot = (key.device, key.dtype)
                need[slot] = need.get(slot, 0) + piece.numel
    return need
