"""The buffers a checkpointed module's forward updates, as its recomputation in backward must find and leave them.

[Note: buffers under recomputation]
A forward may update buffers as it runs: BatchNorm's running statistics and batch count, spectral norm's
power-iteration vectors, a running average of the user's own. The recomputation in backward runs that forward
again, so under torch's checkpoint each of them is updated twice a step (pytorch/pytorch#96136): BatchNorm counts
every batch twice and its running statistics drift from those of the run without checkpointing, and spectral norm's
recomputed weight is one power iteration further on than the weight forward used, so even the gradients differ.
Activation checkpointing changes nothing but memory here, so around each recomputation the buffers its forward
updated are set to what they held when that forward began, and afterwards put back as they were before the
recomputation: one update a step, and the recomputed forward is the forward that ran.

Which buffers a module's forward updates is learned at its first forward that records a graph (every buffer of the
module is copied that once), from the tensors' version counters and from buffers replaced by new tensors; later
forwards copy only those, and a few vectors per layer wait for the backward. The running statistics of
normalization layers, which the batch-norm kernels write without bumping the version counter, are known by kind
instead: those of every ``_NormBase`` layer training with ``track_running_stats``, at each forward.
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch import nn

from lightning_zero.torch_versions.nn import NormBase

Key = tuple[nn.Module, str]  # a buffer, as (the module that registered it, its name there)

_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


class ForwardBuffers:
    """One forward's buffers, for its recomputation: what the updated ones held when the forward began. Entered
    around each recomputation (a graph differentiated twice recomputes twice)."""

    def __init__(
        self, before: dict[Key, torch.Tensor], versions: dict[Key, tuple[torch.Tensor, int]], running: set[Key]
    ) -> None:
        self.before = before
        self.versions = versions
        self.running = running
        self.updated: set[Key] = set()
        self._restore: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []

    def ended(self, ignore: set[Key]) -> set[Key]:
        """The forward ended: which buffers it updated (those of ``ignore`` only when known by kind); their values
        at its start are kept, the others' copies dropped."""
        changed = {
            key
            for key, (tensor, version) in self.versions.items()
            if key[0]._buffers.get(key[1]) is not tensor or tensor._version != version
        }
        self.updated = self.running | (changed - ignore)
        self.before = {key: value for key, value in self.before.items() if key in self.updated}
        self.versions = {}
        return changed - ignore

    @torch.no_grad()
    def __enter__(self) -> None:
        for owner, name in self.updated:
            tensor = owner._buffers.get(name)
            if tensor is None:
                continue
            self._restore.append((owner, name, tensor, tensor.clone()))
            start = self.before.get((owner, name))
            if start is None:
                continue
            if start.shape == tensor.shape and start.dtype == tensor.dtype:
                tensor.copy_(start)
            else:  # the forward replaced it by a tensor of another shape
                owner._buffers[name] = start.clone()

    @torch.no_grad()
    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        restore, self._restore = self._restore, []
        for owner, name, tensor, value in restore:
            owner._buffers[name] = tensor
            tensor.copy_(value)


class BufferUpdates:
    """One checkpointed module's buffers and which of them its forward updates (see [Note: buffers under
    recomputation])."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._keys: list[Key] | None = None
        self._norms: list[NormBase] = []
        self._norm_keys: set[Key] = set()
        self._updated: set[Key] | None = None  # None until the first forward that records a graph

    def _find(self) -> list[Key]:
        if self._keys is None:
            self._keys = [
                (owner, name)
                for owner in self.module.modules()
                for name, buffer in owner._buffers.items()
                if buffer is not None
            ]
            self._norms = [m for m in self.module.modules() if isinstance(m, NormBase)]
            self._norm_keys = {(m, name) for m in self._norms for name in _RUNNING}
        return self._keys

    def begin(self) -> ForwardBuffers | None:
        """A forward begins: what its recomputation will need (None: it records no graph, or there are no buffers)."""
        keys = self._find()
        if not keys or not torch.is_grad_enabled():
            return None
        running: set[Key] = {
            (m, name)
            for m in self._norms
            if m.training and m.track_running_stats
            for name in _RUNNING
            if m._buffers.get(name) is not None
        }
        copied = keys if self._updated is None else self._updated | running
        buffers = {key: tensor for key in keys if (tensor := key[0]._buffers.get(key[1])) is not None}
        before = {key: buffers[key].detach().clone() for key in copied if key in buffers}
        return ForwardBuffers(before, {key: (tensor, tensor._version) for key, tensor in buffers.items()}, running)

    def end(self, forward: ForwardBuffers) -> None:
        """The forward that :meth:`begin` began ended: learn which buffers it updated."""
        found = forward.ended(self._norm_keys)
        self._updated = found if self._updated is None else self._updated | found
