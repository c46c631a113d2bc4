"""Master shards of this rank's parameters, where the optimizer steps them: on the device, or in host memory
(ZeRO-Offload).

[Note: the offloaded step]
With ``offload_optimizer`` the optimizer is re-hosted (see ``sharded_optimizer.py``) on fp32 master rows that
live in host memory, so its state is born there too. One step is then:

1. device->host: when the gradients are finalized (averaged, unscaled), each reduced shard is copied, cast
   to fp32, into a host buffer allocated once and reused, and averaged there: no fp32 gradient shard is
   ever made on the device. Clipping and the overflow check then read the host copies;
2. the user's optimizer steps the host masters (torch's fused CPU kernel when the optimizer has one and the
   user did not choose a kernel, see :func:`host_kernel`);
3. host->device: the updated rows are copied into the device's parameter shard, bucket by bucket, each
   bucket's copy overlapping the all-gather of the one before.

With an accelerator the host buffers are pinned and the copies are ``non_blocking``: all gradient copies are
queued at once and the host waits for them once, and the step's host->device copies run behind the host. A
pinned master is written again only by the next host step, which first waits for that step's gradient
copies, queued after (so finished after) this step's parameter copies. On a CPU-only machine host and device
are the same memory, nothing is pinned (pinning needs an accelerator), and the very same copies run
synchronously: CI exercises the offload path bit for bit.

[Note: partial offload]
``offload_optimizer=r`` with ``0 < r < 1`` (DeepSpeed's ``offload_optimizer.ratio``, ZeRO's Twin-Flow) puts the
masters of about a share ``r`` of this rank's elements in host memory, whole parameters at a time: the largest
first while they fit under ``r`` of the total (:func:`host_share`), so the share on the host is ``r`` up to the
smallest parameters left out. Those follow the path above; the others stay on the device: wider-dtype copies
under mixed precision, else the very rows of the resident parameter (no copy at all, as without offload). One
optimizer step then updates host and device tensors together; the optimizer state follows its tensor.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

HOST = torch.device("cpu")

#: Optimizers with a fused CPU kernel in torch (``fused=True``); on host shards it is several times faster
#: than the per-tensor loop torch picks for CPU tensors by default (AdamW on 41M elements: 30 ms vs 122 ms).
FUSED_ON_CPU: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("Adam", "AdamW", "SGD", "Adagrad") if hasattr(torch.optim, name)
)
#: Those whose fused kernel DTensor can run (stage 3 ``offload_params`` steps FSDP2's DTensor shards directly):
#: ``_fused_sgd_`` and ``_fused_adagrad_`` have no sharding strategy registered.
FUSED_ON_DTENSOR: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


def should_pin(device: torch.device, requested: bool | None) -> bool:
    """Pinned host memory speeds up device<->host copies but needs an accelerator: ``None`` pins exactly when
    the compute device is one; ``True`` on a CPU-only run is ignored with a warning (pinning would fail)."""
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


def wait_for_device(device: torch.device) -> None:
    """Block the host until the device's queued work (e.g. ``non_blocking`` copies) is done."""
    if device.type != "cpu":
        torch.get_device_module(device.type).current_stream(device).synchronize()


class MasterShards:
    """The tensors the optimizer steps in place of this rank's parameter shards.

    ``offloaded=False``: wider-dtype copies on the device (mixed precision); the gradients the engine
    finalizes are used where they are. ``offloaded=True``: copies in host memory (pinned when ``pin``), and
    gradients pass through host buffers. ``dtype=None`` keeps each shard's dtype. Index ``i`` is the engine's
    trainable parameter ``i``.
    """

    def __init__(
        self, shards: Sequence[torch.Tensor], *, dtype: torch.dtype | None, offloaded: bool | float, pin: bool = False,
        alias_on_device: bool = False,
    ) -> None:
        #: Which masters live in host memory (see [Note: partial offload]).
        self.on_host = host_share([s.numel() for s in shards], float(offloaded))
        self.offloaded = any(self.on_host)
        self.pinned = self.offloaded and pin
        self.device = shards[0].device if shards else HOST
        self._dtype = dtype
        #: Masters kept on the device are the given rows themselves (they are exact: masters exist only to be
        #: offloaded), not copies.
        self._alias = alias_on_device
        with torch.no_grad():
            self.tensors = [self._master(i, s) for i, s in enumerate(shards)]
        #: Masters that are the given rows themselves (no memory of their own).
        self.aliased = {i for i, (t, s) in enumerate(zip(self.tensors, shards)) if t is s}
        self._host_ids = {id(t) for t, host in zip(self.tensors, self.on_host) if host}
        self._grad_buffers: dict[int, torch.Tensor] = {}

    def _master(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Master ``index``: a host copy, a wider-dtype device copy, or (device, same dtype) the rows themselves."""
        dtype = self._dtype or rows.dtype
        if self._alias and not self.on_host[index] and dtype == rows.dtype:
            return rows
        return self._allocate(rows, dtype, self.on_host[index]).copy_(rows)

    def rebuild(self, sources: Sequence[int | torch.Tensor]) -> None:
        """Re-index for a grown layout: master ``i`` becomes old master ``sources[i]`` (an index: the same tensor,
        which the optimizer keys its state by) or a fresh copy of the rows ``sources[i]`` (a tensor), placed as the
        offload setting places new masters (on the host under full offload, on the device otherwise)."""
        self._dtype = self._dtype or (self.tensors[0].dtype if self.tensors else None)
        placed = all(self.on_host) and self.offloaded
        self.on_host = [self.on_host[s] if isinstance(s, int) else placed for s in sources]
        with torch.no_grad():
            self.tensors = [self.tensors[s] if isinstance(s, int) else self._master(i, s) for i, s in enumerate(sources)]
        self.aliased = {i for i, s in enumerate(sources) if self.tensors[i] is s or (isinstance(s, int) and s in self.aliased)}
        self._host_ids = {id(t) for t, host in zip(self.tensors, self.on_host) if host}
        self._grad_buffers = {
            new: self._grad_buffers[s] for new, s in enumerate(sources) if isinstance(s, int) and s in self._grad_buffers
        }

    def _allocate(self, like: torch.Tensor, dtype: torch.dtype, on_host: bool) -> torch.Tensor:
        device = HOST if on_host else like.device
        return torch.empty(like.shape, dtype=dtype, device=device, pin_memory=self.pinned and on_host)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype if self.tensors else torch.float32

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tensors[index]

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.tensors)

    def stage_gradient(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """Start copying ``grad`` (cast to the master's dtype) into master ``index``'s host gradient buffer,
        allocated on first use and reused every step; :meth:`gradients_ready` waits for the copies."""
        master = self.tensors[index]
        if not self.on_host[index]:  # partial offload: a device master takes the gradient where it is
            return grad if grad.dtype == master.dtype else grad.to(master.dtype)
        buffer = self._grad_buffers.get(index)
        if buffer is None:
            buffer = self._grad_buffers[index] = self._allocate(master, master.dtype, True)
        if grad is not buffer:
            buffer.copy_(grad, non_blocking=self.pinned)
        return buffer

    def gradients_ready(self) -> None:
        """Wait until the staged gradient copies have landed in host memory."""
        if self.pinned:
            wait_for_device(self.device)

    def receive_gradients(self, grads: Mapping[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
        """The gradients for the masters: the given ones, or (offloaded) their host copies."""
        if not self.offloaded:
            return dict(grads)
        out = {i: None if grad is None else self.stage_gradient(i, grad) for i, grad in grads.items()}
        self.gradients_ready()
        return out

    def copy_into(self, index: int, target: torch.Tensor) -> None:
        """Write master ``index`` into ``target`` (this rank's rows on the device), cast to its dtype."""
        master = self.tensors[index]
        if master is not target:
            target.copy_(master, non_blocking=self.pinned and self.on_host[index])

    def refresh_from(self, index: int, source: torch.Tensor) -> None:
        """Take master ``index`` from ``source`` (after a checkpoint was loaded into the device shard)."""
        if self.tensors[index] is not source:
            self.tensors[index].copy_(source)

    def holds_on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of the masters placed in host memory."""
        return id(tensor) in self._host_ids  # the masters live as long as this object: their ids stay theirs

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """``(kind, tensor, on_host)`` of the memory the masters hold: copies and host gradient buffers."""
        for i, master in enumerate(self.tensors):
            if i not in self.aliased:
                yield "masters", master, self.on_host[i]
        yield from (("grads", grad, True) for grad in self.gradient_buffers)

    @property
    def gradient_buffers(self) -> list[torch.Tensor]:
        """The host gradient buffers allocated so far (offloaded only)."""
        return list(self._grad_buffers.values())


def host_share(elements: Sequence[int], ratio: float) -> list[bool]:
    """Which of tensors of ``elements`` go to the host for a share ``ratio`` of their total: all for 1, none for 0,
    else the largest first while the host's total stays within ``ratio`` of the whole (see [Note: partial offload])."""
    if ratio >= 1.0:
        return [True] * len(elements)
    chosen, budget = [False] * len(elements), ratio * sum(elements)
    used = 0
    for i in sorted(range(len(elements)), key=lambda i: (-elements[i], i)):
        if ratio > 0 and used + elements[i] <= budget:
            chosen[i] = True
            used += elements[i]
    return chosen


@contextlib.contextmanager
def host_kernel(optimizer: Optimizer, enabled: bool = True) -> Iterator[None]:
    """Run a step on host tensors with torch's fused CPU kernel, for the param groups where the user left the
    choice to torch (``fused`` and ``foreach`` both unset); an explicit choice is kept. The groups' settings
    are restored afterwards, so checkpoints and ``state_dict`` show the user's own values."""
    if not enabled or not isinstance(optimizer, FUSED_ON_CPU):
        yield
        return
    dtensor_ok = isinstance(optimizer, FUSED_ON_DTENSOR)
    chosen = [
        group
        for group in optimizer.param_groups
        if "fused" in group and group["fused"] is None and group.get("foreach") is None and not group.get("differentiable")
        and (dtensor_ok or not any(isinstance(p, DTensor) for p in group["params"]))
    ]
    for group in chosen:
        group["fused"] = True
    try:
        yield
    finally:
        for group in chosen:
            group["fused"] = None
