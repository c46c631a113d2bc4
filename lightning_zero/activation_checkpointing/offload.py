"""Activation offload: the inputs a checkpointed module keeps, held in host memory from its forward to its
recomputation.

[Note: offloaded checkpoint inputs]
Under activation checkpointing a block keeps only its inputs, and at long sequences those are what is left on the
device: one ``[B, T, d]`` hidden state per block, ``L`` of them alive at the end of forward. With offload, each input
of a checkpointed forward that requires grad (the hidden states flowing from block to block; attention masks, rotary
tables and position ids are the same tensors for every block, so moving them would free nothing, and a tensor that
requires grad and reaches every block, as T5's position bias does, is copied once, by the first) is copied to host
memory (pinned where there is an accelerator) on a copy stream while the block computes, and torch's checkpoint keeps
a :class:`HostCopy` in its place. When backward recomputes a block, the block takes its inputs back and starts
fetching the inputs of the block that ran before it in forward, which backward recomputes next: the copy runs beside
this block's recomputation and backward, one block ahead, as DeepSpeed's ``cpu_checkpointing`` does. The bytes are
the same, so every result equals checkpointing without offload.

The checkpoint is handed an empty tensor on the inputs' device as its first argument, so it still saves and
restores that device's random state for the recomputation (it infers the device from its tensor arguments, and
the host copies are not tensors to it).

On a run without an accelerator the host is the device. The copies are still made (the path is the one a GPU run
takes) outside torch's dispatch modes, so that a tracker counting the run's device tensors (the planner's
``PeakMemory``) counts what stays on the device, and the bytes moved are in :class:`OffloadStatistics`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_zero.torch_versions.tracing import outside_dispatch_modes, tree_map_only


@dataclasses.dataclass
class OffloadStatistics:
    """What the offload moved: cumulative bytes each way, and the bytes held in host memory now and at most."""

    offloaded_bytes: int = 0
    fetched_bytes: int = 0
    prefetched_bytes: int = 0
    """The part of ``fetched_bytes`` fetched ahead, while the block recomputed before it."""
    host_bytes: int = 0
    peak_host_bytes: int = 0


class HostCopy:
    """One offloaded input: its host copy, and the device copy fetched for a recomputation."""

    def __init__(self, tensor: torch.Tensor, owner: ActivationOffload) -> None:
        self.owner = owner
        self.device = tensor.device
        self.requires_grad = tensor.requires_grad
        self.nbytes = tensor.numel() * tensor.element_size()
        self.fetched: torch.Tensor | None = None
        self.fetched_event: torch.Event | None = None
        self.host = owner.to_host(tensor)
        owner.hold(self, self.nbytes)

    def fetch(self, ahead: bool) -> None:
        """Start the copy back to the device (on the copy stream where there is one)."""
        if self.fetched is None:
            self.fetched, self.fetched_event = self.owner.to_device(self.host, self.device)
            self.owner.statistics.fetched_bytes += self.nbytes
            if ahead:
                self.owner.statistics.prefetched_bytes += self.nbytes

    def take(self) -> torch.Tensor:
        """The device copy for a recomputation, as the original required grad; the next recomputation (a second
        backward through the same graph) fetches again."""
        self.fetch(ahead=False)
        tensor, event = self.fetched, self.fetched_event
        self.fetched = self.fetched_event = None
        if tensor is None:
            raise RuntimeError("lightning_zero internal error: a fetched activation went missing")
        if event is not None:
            self.owner.compute_stream(self.device).wait_event(event)
            tensor.record_stream(self.owner.compute_stream(self.device))
        return tensor.requires_grad_(self.requires_grad)


class OffloadedCall:
    """One checkpointed forward's arguments with its offloaded inputs as :class:`HostCopy`; what torch's checkpoint
    keeps for the recomputation, which it runs through :meth:`recompute`."""

    def __init__(self, module: nn.Module, previous: OffloadedCall | None) -> None:
        self.module = module
        self.copies: list[HostCopy] = []
        self.previous = weakref.ref(previous) if previous is not None else None

    def offload(self, args: tuple[Any, ...], kwargs: dict[str, Any], owner: ActivationOffload) -> tuple[Any, Any]:
        def to_host(tensor: torch.Tensor) -> Any:
            if not tensor.requires_grad or owner.shared(tensor):
                return tensor
            copy = HostCopy(tensor, owner)
            self.copies.append(copy)
            return copy

        return tree_map_only(torch.Tensor, to_host, (args, kwargs))

    def recompute(self, anchor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The module's forward again, on its inputs fetched back; the block before it starts fetching."""
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            for copy in previous.copies:
                copy.fetch(ahead=True)
        args, kwargs = tree_map_only(HostCopy, HostCopy.take, (args, kwargs))
        return self.module(*args, **kwargs)


class ActivationOffload:
    """The host tier of one model's checkpointed inputs: the copy streams, the chain of forwards that tells a
    recomputation which inputs to fetch next (see [Note: offloaded checkpoint inputs]), and the statistics."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = pin_memory
        self.statistics = OffloadStatistics()
        self._last: weakref.ref[OffloadedCall] | None = None
        self._streams: dict[torch.device, torch.Stream] = {}
        self._inputs: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def shared(self, tensor: torch.Tensor) -> bool:
        """Whether an earlier checkpointed forward took this very tensor (T5's position bias, a decoder's encoder
        states): every block holds it, so copies would free nothing; the first forward's copy is the only one."""
        if self._inputs.get(id(tensor)) is tensor:
            return True
        self._inputs[id(tensor)] = tensor
        return False

    def start(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None:
        """What torch's checkpoint should run and keep for this forward of ``module``: ``(function, args,
        kwargs)`` with the inputs offloaded, or None when nothing is (no input requires grad)."""
        moving = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if not moving:
            return None
        device = moving[0].device
        last = self._last() if self._last is not None else None
        call = OffloadedCall(module, last)
        host_args, host_kwargs = call.offload(args, kwargs, self)
        self._last = weakref.ref(call)
        anchor = torch.empty(0, device=device)
        return call.recompute, (anchor, *host_args), host_kwargs

    def compute_stream(self, device: torch.device) -> torch.Stream:
        return torch.get_device_module(device.type).current_stream(device)

    def _copy_stream(self, device: torch.device) -> torch.Stream:
        if device not in self._streams:
            self._streams[device] = torch.get_device_module(device.type).Stream(device)
        return self._streams[device]

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        if source.device.type == "cpu":
            with outside_dispatch_modes():
                return source.clone()
        pin = self.pin_memory is not False
        host = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
        stream = self._copy_stream(source.device)
        stream.wait_stream(self.compute_stream(source.device))
        source.record_stream(stream)
        with torch.get_device_module(source.device.type).stream(stream):
            host.copy_(source, non_blocking=pin)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Event | None]:
        if device.type == "cpu":
            return host.clone(), None
        stream = self._copy_stream(device)
        with torch.get_device_module(device.type).stream(stream):
            tensor = host.to(device, non_blocking=host.is_pinned())
            event = torch.Event(device=device)
            event.record(stream)
        return tensor, event

    def hold(self, copy: HostCopy, nbytes: int) -> None:
        statistics = self.statistics
        statistics.offloaded_bytes += nbytes
        statistics.host_bytes += nbytes
        statistics.peak_host_bytes = max(statistics.peak_host_bytes, statistics.host_bytes)
        weakref.finalize(copy, _release, statistics, nbytes)


def _release(statistics: OffloadStatistics, nbytes: int) -> None:
    statistics.host_bytes -= nbytes


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, found.append, tree)
    return found
