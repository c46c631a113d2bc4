"""A part's host step started before the clipping coefficient is known, and its undo (SuperOffload's
speculate-then-validate).

[Note: speculative clipping]
Clipping by the global norm needs every gradient, so with ``gradient_clip_val`` no part of the offloaded step could
start during backward ([Note: the host step during backward] in ``schedule.py``), and the host read the gradients twice
more after it (the norm, then the scale). The clip rarely fires once training settles (0.12% of BLOOM's steps, in
SuperOffload's report), and where it does not, its coefficient is exactly 1 and clipping changes nothing. So a part
starts during backward as without clipping, and before it steps, the worker

1. takes the 2-norm of each of its gradients with the very kernel the clip's norm uses (``torch._foreach_norm``, one
   fp32 value per tensor), so the global norm later combines these values, in the same order, into the same sum
   (stages 1-2, where the clip reads the gradients the parts step; stage 3's clip reads the device's and takes them
   itself);
2. copies what the step will write: each master and its optimizer state (a master's state made by this first step
   is noted as absent).

When backward ends the clip computes the global norm (the parts' norms taken, the rest computed) and its coefficient.
If it is 1, the parts stand: the step is the one the serial path would have taken, since multiplying by 1 changes no
bit. If the clip fires, every started part is put back from its copy (an arithmetic undo would not be bitwise) and
forgotten, the gradients are scaled as always, and the step runs every part serially: bit for bit the clipped step.
A non-finite norm counts as firing (the serial step scales every gradient by NaN), and any other change of the
gradients after backward (``OptimizerShards.local_gradients(for_change=True)``) puts the parts back the same way. The
copies cost host memory, the part's masters and state (12 bytes an element under Adam with fp32 state), counted by the
planner; a step where the clip fires pays the parts' host step twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


class CopyBuffers:
    """The buffers the copies are written into, by ``id(tensor)``, kept from step to step (a fresh allocation each
    step would fault its pages in again, which on the host costs as much as the copy). Those no copy used since the
    last :meth:`forget_unused` go then: a tensor replaced (a state loaded from a checkpoint) or no longer speculated
    leaves nothing behind."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._used: set[int] = set()

    def copied(self, tensor: torch.Tensor) -> torch.Tensor:
        key = id(tensor)
        buffer = self._buffers.get(key)
        if (
            buffer is None
            or buffer.shape != tensor.shape
            or buffer.dtype != tensor.dtype
            or buffer.device != tensor.device
        ):
            buffer = self._buffers[key] = torch.empty_like(tensor)
        self._used.add(key)
        return buffer.copy_(tensor)

    def forget_unused(self) -> None:
        self._buffers = {key: buffer for key, buffer in self._buffers.items() if key in self._used}
        self._used = set()

    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())


@dataclasses.dataclass
class Speculation:
    """What a speculated part needs to be validated and, if the clip fires, undone."""

    norms: dict[int, torch.Tensor]
    """``id(gradient)`` -> its 2-norm (fp32, 0-dim), as ``torch._foreach_norm`` gives it."""
    saved: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any] | None]]
    """Each stepped tensor, a copy of it, and a copy of its optimizer state (None: it had none yet)."""

    @classmethod
    @torch.no_grad()
    def before_step(
        cls,
        optimizer: Optimizer,
        standins: Mapping[int, tuple[torch.Tensor, torch.Tensor | None] | None],
        buffers: CopyBuffers,
        take_norms: bool = True,
    ) -> Speculation:
        """Called with the part's gradients final (averaged), before its step writes anything; the copies go into
        ``buffers``, which stay with the caller for the next step. ``take_norms``: the clip reads the very gradients the
        part steps (stages 1-2), so their norms taken here stand in for its own; stage 3's clip reads the device's
        gradients (or DTensors, whose norm would be a collective in this thread) and takes them itself."""
        stepped = [standin for standin in standins.values() if standin is not None and standin[1] is not None]
        grads = (
            [grad for _, grad in stepped if grad is not None and not isinstance(grad, DTensor)] if take_norms else []
        )
        norms = dict(zip(map(id, grads), torch._foreach_norm(grads, 2.0))) if grads else {}
        saved = []
        for tensor, _ in stepped:
            entry = optimizer.state.get(tensor)
            state = (
                {
                    k: buffers.copied(v) if isinstance(v, torch.Tensor) and v.dim() else _kept(v)
                    for k, v in entry.items()
                }
                if entry
                else None
            )
            saved.append((tensor, buffers.copied(tensor), state))
        return cls(norms, saved)

    @torch.no_grad()
    def undo(self, optimizer: Optimizer) -> None:
        """Put every stepped tensor and its state back as they were before the step."""
        for tensor, copy, state in self.saved:
            tensor.copy_(copy)
            if state is None:
                optimizer.state.pop(tensor, None)
                continue
            entry = optimizer.state[tensor]
            for key, value in state.items():
                held = entry.get(key)
                if isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and held.shape == value.shape:
                    held.copy_(value)  # into the tensor the state holds now (its dtype: the copy's)
                else:
                    entry[key] = _kept(value)


def _kept(value: object) -> object:
    """A step count (0-dim) or a number, as it was: copied, since the step changes tensors in place."""
    return value.clone() if isinstance(value, torch.Tensor) else value
