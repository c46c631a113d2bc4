"""The user's optimizer, stepping only this rank's shard of every parameter (stages 1 and 2).

[Note: re-hosting without replacing the optimizer]
The optimizer object the user built stays the one Lightning, LR schedulers and ``toggle_optimizer`` see: its
``param_groups`` keep the real parameters. For the duration of ``step`` each trainable parameter is swapped for a
persistent view of this rank's rows of it, with this rank's reduced gradient shard, so the optimizer keys its state by
those views and the state is born sharded, never existing at full size. The views alias the resident parameters, so no
fp32 master copy exists; after the step the updated rows are all-gathered back.

Under a mixed-precision policy, or with ``offload_optimizer``, the hosted tensors are the engine's master rows instead
(see ``engine/offload/``), copied and cast into the resident rows after the step.

Matrix optimizers (Muon, Adafactor: ``optimizers.optimizer_kind``) step whole parameters on owner ranks (see
[Note: owner stepping] in ``owner_step.py``); their element-wise groups stay on shards.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_zero.engine.api import OptimizerShards, ShardRecord
from lightning_zero.engine.in_place_writes import InPlaceWrites
from lightning_zero.engine.offload.host_step import step_on_host
from lightning_zero.engine.offload.masters import MasterShards
from lightning_zero.engine.offload.schedule import (
    HostPart,
    HostStepSchedule,
    StepMode,
    runs_behind_copies,
    split_in_parts,
)
from lightning_zero.engine.offload.selective import AdamHyper, SelectiveParam, SelectiveSettings, SelectiveUpdates
from lightning_zero.engine.optimizer_shell import OptimizerShell
from lightning_zero.engine.optimizers import Standins, has_step_hooks, hosted_params, steps_in_parts, steps_whole
from lightning_zero.engine.owner_step import OwnerStepping
from lightning_zero.engine.stage12.grad_sync import GradientReducer
from lightning_zero.engine.stage12.layout import ShardLayout
from lightning_zero.engine.stage12.param_gather import RowViews, all_gather_params
from lightning_zero.engine.stage12.zero_param import ZeroParam, finalize_landed


class ShardedOptimizer(OptimizerShell):
    """Steps ``optimizer`` on this rank's shards and all-gathers the updated parameters (an
    :class:`~lightning_zero.engine.api.OptimizerShards`)."""

    def __init__(
        self,
        optimizer: Optimizer,
        zero_params: Sequence[ZeroParam],
        layout: ShardLayout,
        reducer: GradientReducer,
        *,
        rank: int,
        schedule: HostStepSchedule,
        masters: MasterShards | None = None,
        group: dist.ProcessGroup | None = None,
        elsewhere: set[int] | frozenset[int] = frozenset(),
        shards: dict[int, torch.Tensor] | None = None,
        kind: str = "elementwise",
        owners: OwnerStepping | None = None,
        written: InPlaceWrites | None = None,
        selective: SelectiveSettings | None = None,
        carried: SelectiveUpdates | None = None,
    ) -> None:
        super().__init__(optimizer, kind, schedule)
        #: See [Note: parameters written between steps] (``engine/in_place_writes.py``).
        self.written = written
        #: ``id``s of the parameters another pipeline stage holds and steps (see ``api.Holding``).
        self.elsewhere = elsewhere
        self.masters = masters
        self.layout = layout
        self.reducer = reducer
        self.rank = rank
        self.group = group
        #: The engine's parameters (``zero_param.py``); ``params`` holds the same, for the helpers that take tensors.
        self.zero_params = list(zero_params)
        self.params = [zp.param for zp in self.zero_params]
        params = self.params
        self._index = {id(p): i for i, p in enumerate(self.params)}
        #: Persistent, because the optimizer keys its state by them.
        self.shards: dict[int, torch.Tensor] = dict(shards or {})
        self.owners = owners
        if owners is None and kind == "matrix":
            device = params[0].device if params else torch.device("cpu")
            dtype = masters.dtype if masters is not None else params[0].dtype if params else torch.float32
            self.owners = OwnerStepping(
                rank=rank,
                world_size=layout.world_size,
                group=group,
                comm_device=device,
                dtype=dtype,
                resident=masters is None,
            )
            self.owners.on_host = masters is not None and masters.offloaded
        self.row_views = RowViews(layout)
        self._members: tuple[int, ...] | None = None
        self._untracked: list[nn.Parameter] = []
        if schedule.delayed and (kind == "matrix" or masters is None or not all(masters.on_host)):
            raise TypeError(
                f"ZeroStrategy(offload_step_delay=1) steps {type(optimizer).__name__} in a background thread on host "
                "masters: it needs an element-wise optimizer (torch's SGD, Adam, AdamW, ...) and every master on the "
                "host (`offload_optimizer=True`). Use offload_step_delay=0 for this optimizer."
            )
        #: See [Note: selective updates] in ``engine/offload/selective.py``.
        self.selective = carried
        self._selective_settings = selective
        self.refresh()

    def refresh(self) -> None:
        """Follow ``param_groups``: callbacks such as ``BackboneFinetuning`` add groups during training. Under a matrix
        optimizer a group's marks decide too, so it is followed every step."""
        groups = self.optimizer.param_groups
        members = tuple(map(id, itertools.chain.from_iterable([group["params"] for group in groups])))
        if members == self._members and self.kind != "matrix" and not any(p.requires_grad for p in self._untracked):
            return
        untracked: list[nn.Parameter] = []
        indices: list[int] = []
        whole: list[int] = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                i = self._index.get(id(p))
                if i is None and id(p) not in self.elsewhere:
                    untracked.append(p)
                    if p.requires_grad:
                        raise RuntimeError(
                            f"A parameter of shape {tuple(p.shape)} in {type(self.optimizer).__name__}'s param_groups "
                            "was frozen (or not part of the model) when this step began, so it has no shard and no "
                            "gradient reduction. Unfreeze parameters between steps (e.g. in `on_train_epoch_start`, "
                            "as `BackboneFinetuning` does), not between a step's backward and its optimizer step."
                        )
                if i is None:
                    continue
                indices.append(i)
                if steps_whole(group, self.kind):
                    whole.append(i)
                elif i not in self.shards:
                    self.shards[i] = self.zero_params[i].optimizer_rows()
        self.indices = indices
        self.whole = whole
        if whole:
            self._owners.adopt({i: torch.Size(self.layout.params[i].shape) for i in whole}, self._whole_tensor)
        self.buckets = sorted({self.layout.params[i].bucket for i in indices})
        #: Runs of buckets in the order the next forward needs them (buckets are planned in backward order).
        self.parts: list[HostPart] = []
        if self.masters is not None and self.masters.offloaded and not whole:
            by_bucket: dict[int, list[int]] = {b: [] for b in reversed(self.buckets)}
            for i in indices:
                by_bucket[self.layout.params[i].bucket].append(i)
            buckets = list(by_bucket)
            runs = split_in_parts([sum(self.layout.params[i].chunk_numel for i in by_bucket[b]) for b in buckets])
            self.parts = [
                HostPart(tuple(buckets[k] for k in run), tuple(i for k in run for i in by_bucket[buckets[k]]))
                for run in runs
            ]
        self._members, self._untracked = members, untracked
        if self._selective_settings is not None:
            self._follow_selective(self._selective_settings)

    def _follow_selective(self, settings: SelectiveSettings) -> None:
        """Selective updates for this optimizer's parameters, new ones included (callbacks add param groups)."""
        masters = self.masters
        if masters is None or not masters.offloaded or not all(masters.on_host) or self.whole:
            raise TypeError(
                f"ZeroStrategy(offload_update_interval>1) needs every master of {type(self.optimizer).__name__} on the "
                "host (offload_optimizer=True) and an element-wise optimizer (Adam, AdamW)."
            )
        if self.selective is None:
            self.selective = SelectiveUpdates(
                self.optimizer,
                settings,
                [],
                self.schedule.worker,
                group=self.group,
                shard_of=self.shards.__getitem__,
                resident_rows=self._resident_rows,
                masters_into_resident=self._masters_into_resident,
            )
        else:  # carried over a growth of the layout
            self.selective.bind(self.shards.__getitem__, self._resident_rows, self._masters_into_resident)
        for i in self.indices:
            if i not in self.selective.params:
                shape = torch.Size(self.layout.params[i].shape)
                columns = SelectiveParam.columns_of(shape)
                selectable = len(shape) >= 2
                self.selective.adopt(
                    SelectiveParam(
                        index=i,
                        name=self.zero_params[i].name,
                        columns=columns,
                        selectable=selectable,
                        device=self.params[i].device,
                        column_steps=torch.zeros(columns, dtype=torch.float64),
                        selected=torch.full((columns,), not selectable, dtype=torch.bool),
                    )
                )

    def _whole_tensor(self, i: int) -> torch.Tensor:
        if self.masters is None:
            return self.params[i].detach()
        device = torch.device("cpu") if self.masters.offloaded else self.params[i].device
        return torch.zeros(
            self.layout.params[i].shape, dtype=self.masters.dtype, device=device, pin_memory=self.masters.pinned
        )

    def _param(self, i: int) -> torch.Tensor:
        return self.params[i]

    def _ordered_records(self) -> list[ShardRecord]:
        return [record for i in self.indices if (record := self.zero_params[i].record) is not None]

    def _hosted_shards(self) -> dict[int, torch.Tensor]:
        return {id(self.params[i]): self.shards[i] for i in self.indices if i in self.shards}

    def _gradients(self) -> list[torch.Tensor]:
        grads = (self.reducer.local_grad(i) for i in self.indices)
        return [g for g in grads if g is not None]

    def _discard(self) -> None:
        """A delayed update still lands, so the parameters a step computes with do not depend on which steps were
        skipped; a selective step is skipped whole (its host step lands at its own step)."""
        if self.selective is None:
            self.land()
        self.reducer.consume(self.indices)

    def settle(self) -> None:
        super().settle()
        if self.selective is not None:
            self.selective.write_back()

    def state_loaded(self) -> None:
        super().state_loaded()
        if self.selective is not None:
            self.selective.pull_all()

    @contextlib.contextmanager
    def hosting(self) -> Iterator[None]:
        """See [Note: re-hosting without replacing the optimizer]."""
        self.settle()
        with hosted_params(self.optimizer, self._standins()):
            yield

    def _standins(self, part: Sequence[int] | None = None) -> Standins:
        """With ``part``, the others sit the step out."""
        whole = set(self.whole)
        grads = {i: self.reducer.local_grad(i) for i in (self.indices if part is None else part) if i not in whole}
        if self.masters is not None:
            grads = self.masters.receive_gradients(grads)
        standins: Standins = {id(self.params[i]): (self.shards[i], grads[i]) for i in grads}
        if part is not None:
            standins.update({id(self.params[i]): None for i in self.indices if id(self.params[i]) not in standins})
        standins.update(self._owner_standins())
        return standins

    def step_during_backward(self, clipped: bool = False) -> bool:
        """See [Note: the host step during backward] in ``engine/offload/schedule.py``; False where the step waits
        for :meth:`step`."""
        self.take_back_writes()
        masters = self.masters
        on_host = masters is not None and masters.offloaded and all(masters.on_host)
        eligible = not self.whole and self.selective is None
        return self.schedule.arm(self.parts, on_host, eligible=eligible, speculative=clipped)

    def bucket_landed(self, bucket: int) -> None:
        part = self.schedule.landed(bucket)
        if part is None or self.masters is None:
            return
        finalized = finalize_landed(
            [self.zero_params[i] for i in part.indices], self.reducer.world_size * self.reducer.replicas
        )
        if finalized is None:
            return
        grads, _ = finalized
        standins: Standins = {id(self.params[i]): None for i in self.indices}
        standins.update({id(self.params[i]): (self.shards[i], grad) for i, grad in zip(part.indices, grads)})
        self.schedule.start(part, standins, self.masters.gradient_copies_queued(), average=finalized)

    def finalize_gradients(self, scale: float = 1.0) -> None:
        self.reducer.finalize(self.indices, scale)

    def step(self, **kwargs: Any) -> object:
        self.refresh()
        mode = self.schedule.mode
        if mode is not StepMode.DURING_BACKWARD:  # else taken back before the backward that started them
            self.take_back_writes()
        self.reducer.finalize(self.indices)
        if self.selective is not None:
            self._step_selectively(self.selective)
            return None
        if self.whole:
            self._owners.gather(self.whole, self.local_rows, self.reducer.local_grad)
        if mode is StepMode.DELAYED:
            self._step_delayed(**kwargs)
            return None
        if mode is StepMode.DURING_BACKWARD or (len(self.parts) > 1 and steps_in_parts(self.optimizer)):
            return self._step_in_parts(**kwargs)
        self.settle()
        offloaded = self.masters is not None and self.masters.offloaded
        result = step_on_host(self.optimizer, self._standins(), kernel=offloaded, states=self.schedule.states, **kwargs)
        if self.whole:
            with torch.no_grad():
                self._owners.scatter(self.whole, self._write_rows)
        self.reducer.consume(self.indices)
        self.all_gather_params()
        return result

    def _step_in_parts(self, **kwargs: Any) -> object:
        """See [Note: the offloaded step] in ``engine/offload/schedule.py``: the parts started during backward send
        their rows first, then the rest are stepped here."""
        stepped = self.schedule.send_back(self.schedule.take(), self._send)
        self.settle()
        runs = (
            (HostPart(part.pieces, tuple(rest)), self._standins(rest), None)
            for part in self.parts
            if (rest := [i for i in part.indices if i not in stepped])
        )
        result = self.schedule.step_serially(runs, self._send, **kwargs)
        self.reducer.consume(self.indices)
        return result

    def _step_selectively(self, selective: SelectiveUpdates) -> None:
        """See [Note: selective updates] in ``engine/offload/selective.py``."""
        if self.masters is None:
            raise RuntimeError("lightning_zero internal error: selective updates need host masters")
        grads = self.masters.receive_gradients({i: self.reducer.local_grad(i) for i in self.indices})
        hyper: dict[int, AdamHyper] = {}
        for group in self.optimizer.param_groups:
            settings = AdamHyper.of(self.optimizer, group)
            hyper.update({i: settings for p in group["params"] if (i := self._index.get(id(p))) is not None})
        selective.step(grads, hyper)
        self.reducer.consume(self.indices)
        self.all_gather_params(from_masters=False)

    @property
    def selective_pending(self) -> bool:
        """A selective host step has not landed yet (the parameters forward computes with lag the masters)."""
        return self.selective is not None and self.selective.lands_at is not None

    def _masters_into_resident(self, indices: Sequence[int]) -> torch.Event | None:
        """The copy of host masters into the resident rows; the event behind it (None: synchronous)."""
        if self.masters is None:
            return None
        with torch.no_grad():
            self.masters.copy_all_into([(i, self._resident_rows(i).view(-1)) for i in indices])
        return self.masters.copies_queued()

    def _send(self, part: HostPart) -> None:
        self.all_gather_params(part.pieces, part.indices)

    def _step_delayed(self, **kwargs: Any) -> None:
        """See [Note: the delayed update]."""
        if has_step_hooks(self.optimizer):
            raise RuntimeError(
                f"{type(self.optimizer).__name__} has step hooks, and with offload_step_delay=1 its step runs in a "
                "background thread while training goes on: remove the hooks or use offload_step_delay=0."
            )
        sent = self.land()
        masters = self.masters
        if masters is None:
            raise RuntimeError("a delayed update needs host masters")
        standins = self._standins()
        masters.swap_gradient_buffers(self.indices)
        self.reducer.consume(self.indices)
        runs = runs_behind_copies(self.optimizer, self.parts, self.params, standins, sent, masters.copies_queued())
        self.schedule.start_delayed(runs, **kwargs)

    def land(self) -> list[torch.Event | None]:
        """Collective: bring the delayed host step's rows to every rank's parameters, a part at a time (see
        [Note: the delayed update in parts]). Returns, for each part, an event behind the copies that read its
        masters."""
        if self.selective is not None:
            if self.selective.land():
                self.all_gather_params(from_masters=False)
            return []
        pending = self.schedule.take_pending()
        if pending is None:
            return []
        pending.wait()
        if self.masters is None or len(self.parts) < 2:
            self.all_gather_params()
            return []
        sent: list[torch.Event | None] = []
        for part in self.parts:
            self._send(part)
            sent.append(self.masters.copies_queued())
        return sent

    def take_back_writes(self) -> None:
        """See [Note: parameters written between steps]."""
        if self.written is not None and self.masters is not None:
            self.written.take_back(self.masters, self.indices, self.params.__getitem__, self._resident_rows)

    def _write_rows(self, i: int, rows: torch.Tensor) -> None:
        self.local_rows(i).view(-1).copy_(rows)

    def local_rows(self, i: int) -> torch.Tensor:
        """This rank's rows of parameter ``i`` as the optimizer's truth."""
        return self.zero_params[i].optimizer_rows()

    def _resident_rows(self, i: int) -> torch.Tensor:
        return self.zero_params[i].resident_rows()

    def all_gather_params(
        self, buckets: Sequence[int] | None = None, indices: Sequence[int] | None = None, from_masters: bool = True
    ) -> None:
        """``from_masters=False``: the resident rows hold what to send already (selective updates write them)."""
        gathered = self.buckets if buckets is None else buckets
        indices = self.indices if indices is None else indices
        if self.written is not None and self.masters is not None:
            # The gather rewrites the resident rows of the buckets' other parameters too: what was written into them
            # goes into their masters first, or the new mark would hide it from their own step and from checkpoints.
            copied = set(indices)
            if others := [i for b in gathered for i in self.layout.buckets[b].params if i not in copied]:
                self.written.take_back(self.masters, others, self.params.__getitem__, self._resident_rows)
        with record_function("lightning_zero::param_all_gather"):  # a phase of bench_core's breakdown
            all_gather_params(
                self.layout,
                self.params,
                gathered,
                rank=self.rank,
                group=self.group,
                masters=self.masters if from_masters else None,
                indices=indices,
                compression=self.reducer.compression,
                row_views=self.row_views,
            )
        if self.written is not None:
            self.written.mark(self.params[i] for b in gathered for i in self.layout.buckets[b].params)


if TYPE_CHECKING:  # the optimizer contract (``engine/api.py``)
    _SHARDS: type[OptimizerShards] = ShardedOptimizer
