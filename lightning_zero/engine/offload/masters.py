"""Master shards of this rank's parameters, where the optimizer steps them: on the device, or in host memory
(ZeRO-Offload), with the host buffers their gradients pass through and the stream that copies them (when a step
reads or writes which: [Note: the offloaded step] in ``schedule.py``). Master, staged: [Note: vocabulary] in
``engine/__init__.py``.

[Note: partial offload]
``offload_optimizer=r`` with ``0 < r < 1`` (DeepSpeed's ``offload_optimizer.ratio``, ZeRO's Twin-Flow) puts the masters
of about a share ``r`` of this rank's elements in host memory, whole parameters at a time, largest first
(:func:`host_share`). The others stay on the device: wider-dtype copies under mixed precision, else the resident rows
themselves. One optimizer step then updates host and device tensors together; the state follows its tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence

import torch

HOST = torch.device("cpu")


def master_dtype_of(dtype: torch.dtype, master_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of the master rows of a parameter held in ``dtype``. Complex parameters keep theirs, as autocast and
    the mixed policy leave them: a cast to a real dtype would drop their imaginary parts."""
    if master_dtype is None or not dtype.is_floating_point:
        return dtype
    return master_dtype


def should_pin(device: torch.device, requested: bool | None) -> bool:
    """Pinning needs an accelerator: ``None`` pins exactly when there is one; ``True`` without one warns."""
    accelerated = device.type != "cpu"
    if requested is None:
        return accelerated
    if requested and not accelerated:
        warnings.warn(
            "ZeroStrategy(pin_memory=True) is ignored: the run has no accelerator, and pinning host memory "
            "needs one. Offloaded state lives in ordinary host memory.",
            stacklevel=2,
        )
        return False
    return bool(requested)


class CopyStream:
    """A device stream for the gradient copies to the host (see [Note: the offloaded step]); each batch of copies waits
    for the reductions the compute stream has queued, then runs beside it."""

    def __init__(self, device: torch.device) -> None:
        self.module = torch.get_device_module(device.type)
        self.device = device
        self.stream = self.module.Stream(device)

    @contextlib.contextmanager
    def after_compute(self, sources: Sequence[torch.Tensor]) -> Iterator[None]:
        """``sources`` are recorded on this stream so the caching allocator does not reuse them before they are read."""
        self.stream.wait_stream(self.module.current_stream(self.device))
        for source in sources:
            source.record_stream(self.stream)
        with self.module.stream(self.stream):
            yield

    def event(self, stream: torch.Stream) -> torch.Event:
        event = torch.Event(device=self.device)
        event.record(stream)
        return event

    def wait(self) -> None:
        """Block until every copy and everything queued on the compute stream so far is done."""
        self.stream.wait_stream(self.module.current_stream(self.device))
        self.stream.synchronize()


@dataclasses.dataclass(eq=False)
class Master:
    """One parameter's master rows, where they live, and the host buffers its gradient passes through."""

    tensor: torch.Tensor
    on_host: bool
    aliased: bool
    """The resident rows themselves (kept on the device in their own dtype): they exist only to be offloaded."""
    grad_buffer: torch.Tensor | None = None
    """Host memory the gradient is copied into (made by its first copy)."""
    second_buffer: torch.Tensor | None = None
    """``offload_step_delay``: the buffer the host step in the background reads, while the next backward fills the
    other (see :meth:`MasterShards.swap_gradient_buffers`)."""


class MasterShards:
    """The tensors the optimizer steps in place of this rank's parameter shards, one :class:`Master` each.

    ``offloaded=False``: wider-dtype copies on the device (mixed precision). ``offloaded=True``: copies in host memory,
    with gradients passing through host buffers. Index ``i`` is the engine's trainable parameter ``i``.
    """

    def __init__(
        self,
        shards: Sequence[torch.Tensor],
        *,
        dtype: torch.dtype | None,
        offloaded: bool | float,
        pin: bool = False,
        alias_on_device: bool = False,
    ) -> None:
        #: See [Note: partial offload].
        on_host = host_share([s.numel() for s in shards], float(offloaded))
        self.offloaded = any(on_host)
        self.pinned = self.offloaded and pin
        self.device = shards[0].device if shards else HOST
        self._dtype = dtype
        #: Masters kept on the device in the same dtype are the rows themselves: they exist only to be offloaded.
        self._alias = alias_on_device
        with torch.no_grad():
            self.entries = [self._master(s, host) for s, host in zip(shards, on_host)]
        self._host_ids = {id(m.tensor) for m in self.entries if m.on_host}
        self.copies = CopyStream(self.device) if self.pinned else None

    def _master(self, rows: torch.Tensor, on_host: bool) -> Master:
        dtype = master_dtype_of(rows.dtype, self._dtype)
        if self._alias and not on_host and dtype == rows.dtype:
            return Master(rows, on_host, aliased=True)
        return Master(self._allocate(rows, dtype, on_host).copy_(rows), on_host, aliased=False)

    def rebuild(self, sources: Sequence[int | torch.Tensor]) -> None:
        """Re-index for a grown layout: master ``i`` becomes old master ``sources[i]`` (an index: the same tensor, as
        the optimizer keys its state by it) or a fresh copy of the rows ``sources[i]``."""
        placed = self.offloaded and all(self.on_host)
        with torch.no_grad():
            self.entries = [self.entries[s] if isinstance(s, int) else self._master(s, placed) for s in sources]
        self._host_ids = {id(m.tensor) for m in self.entries if m.on_host}

    def _allocate(self, like: torch.Tensor, dtype: torch.dtype, on_host: bool) -> torch.Tensor:
        device = HOST if on_host else like.device
        return torch.empty(like.shape, dtype=dtype, device=device, pin_memory=self.pinned and on_host)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [m.tensor for m in self.entries]

    @property
    def on_host(self) -> list[bool]:
        return [m.on_host for m in self.entries]

    @property
    def aliased(self) -> set[int]:
        return {i for i, m in enumerate(self.entries) if m.aliased}

    @property
    def dtype(self) -> torch.dtype:
        return self.entries[0].tensor.dtype if self.entries else torch.float32

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.entries[index].tensor

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (m.tensor for m in self.entries)

    def stage_gradients(self, grads: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """Start copying each gradient into its master's host buffer and return the buffers; with an accelerator
        :meth:`gradients_ready` waits for the copies. A master kept on the device takes its gradient where it is."""
        out: list[torch.Tensor] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, grad in grads:
            master = self.entries[index]
            if not master.on_host:
                out.append(grad if grad.dtype == master.tensor.dtype else grad.to(master.tensor.dtype))
                continue
            buffer = master.grad_buffer
            if buffer is None:
                buffer = master.grad_buffer = self._allocate(master.tensor, master.tensor.dtype, True)
            if grad is not buffer:
                copies.append((buffer, grad))
            out.append(buffer)
        if copies and self.copies is not None:
            with self.copies.after_compute([grad for _, grad in copies]):
                for buffer, grad in copies:
                    buffer.copy_(grad, non_blocking=True)
        else:
            for buffer, grad in copies:
                buffer.copy_(grad)
        return out

    def gradients_ready(self) -> None:
        if self.copies is not None:
            self.copies.wait()

    def receive_gradients(self, grads: Mapping[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
        """The gradients for the masters: the given ones, or (offloaded) their landed host copies."""
        if not self.offloaded:
            return dict(grads)
        given = [(i, grad) for i, grad in grads.items() if grad is not None]
        staged = dict(zip((i for i, _ in given), self.stage_gradients(given)))
        if any(staged[i] is not grad for i, grad in given if self.entries[i].on_host):
            self.gradients_ready()
        return {i: staged.get(i) for i in grads}

    def swap_gradient_buffers(self, indices: Sequence[int]) -> None:
        """``offload_step_delay``: give the next backward each master's other buffer, so no gradient copy writes what
        the host step in the background reads."""
        for i in indices:
            master = self.entries[i]
            master.grad_buffer, master.second_buffer = master.second_buffer, master.grad_buffer

    def copies_queued(self) -> torch.Event | None:
        """What a host step must wait for before it writes the masters again (None: the copies were synchronous)."""
        return None if self.copies is None else self.copies.event(self.copies.module.current_stream(self.device))

    def gradient_copies_queued(self) -> torch.Event | None:
        """What a host step must wait for before it reads the gradients (None: the copies were synchronous)."""
        return None if self.copies is None else self.copies.event(self.copies.stream)

    def copy_into(self, index: int, target: torch.Tensor) -> None:
        master = self.entries[index]
        if master.tensor is not target:
            target.copy_(master.tensor, non_blocking=self.pinned and master.on_host)

    def copy_all_into(self, pairs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """:meth:`copy_into` of many masters as two ``foreach`` copies (asynchronous and not), not a dispatch each."""
        batches: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for index, target in pairs:
            master = self.entries[index]
            if not master.aliased:
                targets, sources = batches.setdefault(self.pinned and master.on_host, ([], []))
                targets.append(target)
                sources.append(master.tensor.view(-1))
        for non_blocking, (targets, sources) in batches.items():
            torch._foreach_copy_(targets, sources, non_blocking=non_blocking)

    def refresh_from(self, index: int, source: torch.Tensor) -> None:
        """A checkpoint was loaded into the device shard, or code wrote it."""
        if self.entries[index].tensor is not source:
            self.entries[index].tensor.copy_(source)

    def holds_on_host(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._host_ids  # the masters live as long as this object: their ids stay theirs

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """``(kind, tensor, on_host)`` of the memory the masters hold."""
        for master in self.entries:
            if not master.aliased:
                yield "masters", master.tensor, master.on_host
        yield from (("grads", grad, True) for grad in self.gradient_buffers)

    @property
    def gradient_buffers(self) -> list[torch.Tensor]:
        buffers = [m.grad_buffer for m in self.entries] + [m.second_buffer for m in self.entries]
        return [b for b in buffers if b is not None]


def host_share(elements: Sequence[int], ratio: float) -> list[bool]:
    """Which tensors go to the host for a share ``ratio`` of the elements (see [Note: partial offload])."""
    if ratio >= 1.0:
        return [True] * len(elements)
    chosen, budget = [False] * len(elements), ratio * sum(elements)
    used = 0
    for i in sorted(range(len(elements)), key=lambda i: (-elements[i], i)):
        if ratio > 0 and used + elements[i] <= budget:
            chosen[i] = True
            used += elements[i]
    return chosen
