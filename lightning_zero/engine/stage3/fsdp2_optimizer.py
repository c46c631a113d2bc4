"""The optimizer handle of :class:`~lightning_zero.engine.stage3.fsdp2.FullyShardedEngine` (see its
[Note: stage 3 offload])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.engine.api import OptimizerShards, ShardRecord
from lightning_zero.engine.in_place_writes import InPlaceWrites
from lightning_zero.engine.offload.host_step import host_kernel, step_on_host
from lightning_zero.engine.offload.masters import MasterShards
from lightning_zero.engine.offload.schedule import HostPart, HostStepSchedule, StartedPart, StepMode, split_in_parts
from lightning_zero.engine.optimizer_shell import OptimizerShell
from lightning_zero.engine.optimizers import Standins, hosted_params, steps_in_parts, steps_whole
from lightning_zero.engine.owner_step import OwnerStepping
from lightning_zero.engine.stage3 import fsdp2_private
from lightning_zero.engine.stage3.fsdp2_missing_grads import UnusedParameters
from lightning_zero.engine.stage3.fsdp2_zero_dim_params import ZeroDimParameters
from lightning_zero.engine.stage3.local_step import local_tensor, stepping_local_shards


class ShardedParams(Protocol):
    """What the optimizer handle reads of its :class:`~lightning_zero.engine.stage3.fsdp2.FullyShardedEngine` (a
    Protocol, since the engine imports this module)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def group(self) -> dist.ProcessGroup | None: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def pin_memory(self) -> bool: ...
    @property
    def params_on_host(self) -> bool: ...
    @property
    def optimizer_on_host(self) -> bool: ...
    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def roots(self) -> Sequence[nn.Module]: ...
    @property
    def index(self) -> Mapping[int, int]: ...
    @property
    def masters(self) -> MasterShards | None: ...
    @property
    def unused(self) -> UnusedParameters: ...
    @property
    def zero_dim(self) -> ZeroDimParameters: ...
    def records(self) -> list[ShardRecord]: ...
    def land_gradients(self) -> None: ...
    def reshard(self) -> None: ...


class FullyShardedOptimizer(OptimizerShell):
    """An :class:`~lightning_zero.engine.api.OptimizerShards` stepping the DTensor shards themselves, or, with
    ``offload_optimizer`` alone, their host masters. A matrix optimizer steps whole parameters on owner ranks
    (``owner_step.py``), decided from each DTensor's full shape."""

    def __init__(
        self, engine: ShardedParams, optimizer: Optimizer, schedule: HostStepSchedule, kind: str = "elementwise"
    ) -> None:
        super().__init__(optimizer, kind, schedule)
        self.engine = engine
        if kind == "matrix":
            params = [p for p in self._params() if id(p) in engine.index]
            dtype = engine.masters.dtype if engine.masters is not None else params[0].dtype if params else torch.float32
            self.owners = OwnerStepping(
                rank=engine.rank,
                world_size=engine.world_size,
                group=engine.group,
                comm_device=engine.device,
                dtype=dtype,
            )
            self.owners.on_host = engine.optimizer_on_host
        #: A part per unit (see [Note: the host step during backward] in ``engine/offload/schedule.py``).
        self.unit_parts: list[HostPart] = []
        #: Each unit's trainable parameters, and whether every unit reduces in one collective.
        self._units: tuple[list[list[int]], bool] | None = None
        #: The units' FSDP2 modules, by position, as the last backward's parts were armed.
        self._heads: list[FSDPModule] = []
        #: Reduced again later in this backward, so their parts wait for :meth:`step`.
        self._run_again: set[int] = set()
        #: See [Note: parameters written between steps] (``engine/in_place_writes.py``); a DTensor's own version counts
        #: its in-place operations.
        self.written = InPlaceWrites() if engine.masters is not None else None
        self._refresh()
        self._mark_hosted()

    def _rows(self, i: int) -> torch.Tensor:
        param = self.engine.params[i]
        return local_tensor(param) if isinstance(param, DTensor) else self.engine.zero_dim.rows(param)

    def _grad(self, i: int) -> torch.Tensor | None:
        param = self.engine.params[i]
        return local_grad(param) if isinstance(param, DTensor) else self.engine.zero_dim.grad_rows(param)

    def _params(self) -> Iterable[torch.Tensor]:
        return (p for group in self.optimizer.param_groups for p in group["params"])

    def _refresh(self) -> None:
        engine = self.engine
        self.whole = []
        for group in self.optimizer.param_groups:
            if steps_whole(group, self.kind):
                self.whole += [engine.index[id(p)] for p in group["params"] if id(p) in engine.index]
        if self.whole:
            self._owners.adopt({i: engine.params[i].shape for i in self.whole}, self._whole_tensor)

    def _whole_tensor(self, i: int) -> torch.Tensor:
        engine = self.engine
        on_host = engine.optimizer_on_host
        device = torch.device("cpu") if on_host else self._rows(i).device
        pin = on_host and engine.pin_memory and torch.cuda.is_available()
        return torch.zeros(engine.params[i].shape, dtype=self._owners.dtype, device=device, pin_memory=pin)

    def _hosted_indices(self) -> list[int]:
        engine = self.engine
        if engine.masters is None:
            return []
        whole = set(self.whole)
        return [
            engine.index[id(p)] for p in self._params() if id(p) in engine.index and engine.index[id(p)] not in whole
        ]

    def _sharded_in_place(self) -> list[DTensor]:
        """Neither stepped whole nor re-hosted: the optimizer steps their local tensors (see [Note: local-shard
        step])."""
        engine = self.engine
        elsewhere = set(self.whole) | set(self._hosted_indices())
        return [
            p
            for p in self._params()
            if isinstance(p, DTensor) and id(p) in engine.index and engine.index[id(p)] not in elsewhere
        ]

    def _zero_dim_in_place(self) -> list[int]:
        """See [Note: 0-dim parameters at stage 3] in ``fsdp2_zero_dim_params.py``."""
        zero_dim, index = self.engine.zero_dim, self.engine.index
        if not zero_dim.params:
            return []
        elsewhere = set(self.whole) | set(self._hosted_indices())
        return [
            i for p in self._params() if p in zero_dim and (i := index.get(id(p))) is not None and i not in elsewhere
        ]

    def _masters(self) -> MasterShards:
        if self.engine.masters is None:
            raise RuntimeError("lightning_zero internal error: host masters exist only under offload_optimizer")
        return self.engine.masters

    def _param(self, i: int) -> torch.Tensor:
        return self.engine.params[i]

    def _ordered_records(self) -> list[ShardRecord]:
        engine = self.engine
        return [engine.records()[engine.index[id(p)]] for p in self._params() if id(p) in engine.index]

    def _hosted_shards(self) -> dict[int, torch.Tensor]:
        engine = self.engine
        hosted = {id(engine.params[i]): self._masters()[i] for i in self._hosted_indices()}
        hosted.update({id(engine.params[i]): self._rows(i) for i in self._zero_dim_in_place()})
        return hosted

    @contextlib.contextmanager
    def hosting(self) -> Iterator[None]:
        self.schedule.wait_started()
        engine, indices = self.engine, self._hosted_indices()
        standins: Standins = {}
        if indices:
            masters = self._masters()
            grads = masters.receive_gradients({i: self._grad(i) for i in indices})
            standins = {id(engine.params[i]): (masters[i], grads[i]) for i in indices}
        standins.update(self._owner_standins())
        standins.update({id(engine.params[i]): (self._rows(i), self._grad(i)) for i in self._zero_dim_in_place()})
        if not standins:
            yield
            return
        with hosted_params(self.optimizer, standins):
            yield

    def step(self, **kwargs: Any) -> object:
        """See [Note: stage 3 offload] and [Note: owner stepping] in ``owner_step.py``."""
        engine = self.engine
        engine.land_gradients()
        engine.reshard()  # the step writes the shards: no gathered copy may outlive it
        self._refresh()
        if self.schedule.mode is not StepMode.DURING_BACKWARD:  # else taken back before the backward that started them
            self._take_back_writes()
        if self.whole:
            self._owners.gather(self.whole, self._rows, self._grad)
        early, parts = self.schedule.take(), self._host_parts()
        if early and engine.masters is None:  # offload_params: parts stepped in place during backward
            result = self._step_the_rest_in_place(early, **kwargs)
            engine.zero_dim.share()
            return result
        if early or parts:
            result = self._step_in_parts(parts or [sorted(self._hosted_indices())], early, **kwargs)
            engine.zero_dim.share()
            self._mark_hosted()
            return result
        on_host = engine.masters is not None or engine.params_on_host
        with (
            self.hosting(),
            stepping_local_shards(self.optimizer, self._sharded_in_place()),
            host_kernel(self.optimizer, enabled=on_host),
        ):
            result = self.schedule.states.step(self.optimizer, **kwargs)
        with torch.no_grad():
            for i in self._hosted_indices():
                self._masters().copy_into(i, self._rows(i))
            if self.whole:
                self._owners.scatter(self.whole, self._write_rows)
        engine.zero_dim.share()
        self._mark_hosted()
        return result

    def _step_the_rest_in_place(self, early: Sequence[StartedPart], **kwargs: Any) -> object:
        """``offload_params``: the parts stepped during backward wrote the host shards already (FSDP2 copies them to
        the device at the next all-gather); the rest step here, in one call."""
        stepped = self.schedule.send_back(early, lambda part: None)
        params = self.engine.params
        done: Standins = {id(params[i]): None for i in stepped}
        rest = [p for p in self._sharded_in_place() if self.engine.index[id(p)] not in stepped]
        with (
            self.hosting(),
            hosted_params(self.optimizer, done),
            stepping_local_shards(self.optimizer, rest),
            host_kernel(self.optimizer),
        ):
            return self.schedule.states.step(self.optimizer, **kwargs)

    def _take_back_writes(self) -> None:
        if self.written is not None and self.engine.masters is not None:
            self.written.take_back(
                self.engine.masters, self._hosted_indices(), self.engine.params.__getitem__, self._rows
            )

    def _mark_hosted(self) -> None:
        if self.written is not None:
            self.written.mark(self.engine.params[i] for i in self._hosted_indices())

    def _host_parts(self) -> list[list[int]]:
        """Runs of the hosted parameters in the order the next forward gathers them; none where the step is one call."""
        masters = self.engine.masters
        if masters is None or not masters.offloaded or self.whole or not steps_in_parts(self.optimizer):
            return []
        indices = sorted(self._hosted_indices())
        runs = split_in_parts([masters[i].numel() for i in indices])
        return [[indices[k] for k in run] for run in runs] if len(runs) > 1 else []

    def _step_in_parts(
        self, parts: Sequence[Sequence[int]], early: Sequence[StartedPart] = (), **kwargs: Any
    ) -> object:
        """See [Note: stage 3 offload] in ``fsdp2.py``. Every part's gradient copies are queued first, each behind an
        event, so the host steps a part as soon as its own gradients have landed. They are queued before the ``early``
        parts' masters go back, since behind those on the compute stream they would wait."""
        engine, masters = self.engine, self._masters()
        stepped = {i for started in early for i in started.part.indices}
        staged: list[tuple[HostPart, Standins, torch.Event | None]] = []
        for part in parts:
            rest = tuple(i for i in part if i not in stepped)
            given = [(i, grad) for i in rest if (grad := self._grad(i)) is not None]
            grads = dict(zip((i for i, _ in given), masters.stage_gradients(given)))
            if rest:
                standins = {**self._sitting_out(), **{id(engine.params[i]): (masters[i], grads.get(i)) for i in rest}}
                staged.append((HostPart((), rest), standins, masters.gradient_copies_queued()))
        self.schedule.send_back(early, self._send)
        result = None
        # Parameters the engine does not shard (added to the optimizer after setup) step in a call of their own.
        if any(id(p) not in engine.index and p.grad is not None for p in self._params()):
            in_place: Standins = {id(p): None for p in self._params() if id(p) in engine.index}
            result = step_on_host(self.optimizer, in_place, states=self.schedule.states, **kwargs)
        return self.schedule.step_serially(staged, self._send, **kwargs) if staged else result

    def _send(self, part: HostPart) -> None:
        masters = self._masters()
        with torch.no_grad():
            for i in part.indices:
                masters.copy_into(i, self._rows(i))

    def _sitting_out(self) -> dict[int, tuple[torch.Tensor, torch.Tensor | None] | None]:
        return {id(p): None for p in self._params()}

    def step_during_backward(self, heads: Sequence[FSDPModule], clipped: bool = False) -> bool:
        """See [Note: the host step during backward] in ``engine/offload/schedule.py``; False where the step waits for
        :meth:`step`, as it must where a unit reduces in more than one collective."""
        self._take_back_writes()
        if self._units is None:
            index = self.engine.index
            per_unit = [[index[id(p)] for p, _ in fsdp2_private.sharded_params(h) if id(p) in index] for h in heads]
            self._units = (per_unit, all(fsdp2_private.one_group(h) for h in heads))
        units, one_group_each = self._units
        self._heads = list(heads)
        engine, masters = self.engine, self.engine.masters
        stepped = set(self._hosted_indices()) if masters is not None else set(self._in_place_indices())
        parts = (HostPart((k,), tuple(i for i in indices if i in stepped)) for k, indices in enumerate(units))
        self.unit_parts = [part for part in parts if part.indices]
        eligible = not self.whole and one_group_each
        self._run_again = fsdp2_private.run_more_than_once(heads, engine.roots) if eligible else set()
        on_host = (masters is not None and masters.offloaded and all(masters.on_host)) or (
            masters is None and engine.params_on_host
        )
        return self.schedule.arm(self.unit_parts, on_host, eligible, speculative=clipped, norms_here=False)

    def unit_finished(self, position: int) -> None:
        part = self.schedule.landed(position)
        if part is None or position in self._run_again:
            return
        engine = self.engine
        indices = part.indices
        grads = [self._grad(i) for i in indices]
        if any(grad is None or not engine.unused.produced_here(engine.params[i]) for i, grad in zip(indices, grads)):
            return  # whether no rank used it is known when backward ends
        if engine.masters is None:  # offload_params: the shards themselves, on the host
            self._start_in_place(part, position)
            return
        masters = self._masters()
        if self.written is not None:  # written while gathered (the root through `training_step`)
            self.written.take_back(masters, indices, engine.params.__getitem__, self._rows)
        staged = masters.stage_gradients([(i, grad) for i, grad in zip(indices, grads) if grad is not None])
        standins = {**self._sitting_out(), **{id(engine.params[i]): (masters[i], g) for i, g in zip(indices, staged)}}
        self.schedule.start(part, standins, masters.gradient_copies_queued())

    def _start_in_place(self, part: HostPart, position: int) -> None:
        """``offload_params``: the unit's DTensor shards and their gradients are in host memory already (FSDP2's
        ``CPUOffloadPolicy``), so the part steps them in place, on their local tensors ([Note: local-shard step]),
        once FSDP2's copies of the gradients to the host are done."""
        params = [cast(DTensor, self.engine.params[i]) for i in part.indices]
        events = fsdp2_private.gradient_copy_events(self._heads[position])
        if events is None:
            return  # stepped by `step()`, with the rest
        standins: Standins = {**self._sitting_out(), **{id(p): (p, p.grad) for p in params}}

        @contextlib.contextmanager
        def local_shards(optimizer: Optimizer) -> Iterator[None]:
            for event in events:
                event.synchronize()
            with stepping_local_shards(optimizer, params):
                yield

        self.schedule.start(part, standins, None, inner=local_shards)

    def _in_place_indices(self) -> list[int]:
        index = self.engine.index
        return [index[id(p)] for p in self._sharded_in_place()]

    def _write_rows(self, i: int, rows: torch.Tensor) -> None:
        engine = self.engine
        local = self._rows(i)
        local.view(-1).copy_(rows)
        if engine.masters is not None:
            engine.masters.refresh_from(i, local)

    def _discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finalize_gradients(self, scale: float = 1.0) -> None:
        # FSDP2 already averaged over ranks in its reduce-scatter.
        if scale != 1.0:
            grads = self.local_gradients()
            if grads:
                torch._foreach_mul_(grads, scale)

    def _gradients(self) -> list[torch.Tensor]:
        self.engine.land_gradients()
        grads = (local_grad(p) for p in self._params())
        zero_dim, index = self.engine.zero_dim, self.engine.index
        if zero_dim.params:
            grads = (
                zero_dim.grad_rows(p) if p in zero_dim and id(p) in index else local_grad(p) for p in self._params()
            )
        return [g for g in grads if g is not None]


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    return None if param.grad is None else local_tensor(param.grad)


if TYPE_CHECKING:  # the optimizer contract (``engine/api.py``)
    _SHARDS: type[OptimizerShards] = FullyShardedOptimizer
