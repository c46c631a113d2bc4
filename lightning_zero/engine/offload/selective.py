"""Selective updates (DeepSpeed ZenFlow's idea): the columns whose gradients matter most step on the device every
step, the rest accumulate on the host and step there every ``k`` steps in the background (stages 1-2, optimizer
offloaded, ``ZeroStrategy(offload_update_interval=k, offload_topk_ratio=r)``).

[Note: selective updates]
An offloaded Adam step moves 28 bytes per element through the host's memory, so the host step bounds the step time
however it overlaps (``docs/offload.md``). ZenFlow steps most of the elements less often instead. Here, for each
optimizer of a run with ``offload_update_interval=k > 1``:

* a *column* of a parameter with two or more dimensions is one index of its trailing dimensions (``p.view(p.shape[0],
  -1)``'s columns: for a ``Linear`` weight, one input feature); each rank holds whole rows (``engine/shard.py``), so
  each holds a slice of every column. A parameter of fewer dimensions is one column, always on the device;
* the columns are chosen at the first step, and again at the last step of every ``select_interval`` steps (a
  multiple of ``k``): each rank sums the squares of its rows of the step's gradient per column, the sums are
  all-reduced over the sharding group, and every rank keeps the same ``ceil(r * columns)`` largest (a stable sort:
  ties go to the lower index). The chosen columns' masters and moments live on the device, the others' on the host;
* each step the chosen columns step on the device with this step's gradient (clipped, if the run clips, like the
  whole gradient), and land at once. Every column's gradient is added to a host sum for the interval;
* at the last step of interval ``n`` the host steps the columns on the host with the interval's mean gradient (the
  sum over its steps, divided by ``k``) in the worker thread, and those rows land on the device at a fixed step: the
  last step of interval ``n + 1`` (``overlap_step``, ZenFlow's default), or at once, the step waiting for the host
  (``overlap_step=False``: no staleness from the landing, and the host's time is spent once every ``k`` steps). The
  host step runs over every column; its results for the device's columns are
  never read (the device's values are written over them when rows land, and before anything reads the host state);
* a choice does not wait for the host step in flight. It is made after that step landed and before the next starts:
  a column that joins the device comes from the host and steps the interval's mean gradient there at once (the next
  host step leaves it out), so it is as current as the host would have made it; a column that leaves waits on the
  device, unchanged, while the host step that starts now runs (it writes over that column's host copy), and goes to
  the host when it lands: it is a host column from the next interval on;
* each column counts its own steps, so Adam's bias correction stays right for a column that moves between the device
  (one step a step) and the host (one step per interval);
* a parameter without a gradient in a step (an unused expert) sits that step out: no device step, nothing added, its
  choice kept if the step chooses; the host steps it at the interval's end if some step of the interval gave it a
  gradient.

It is not the exact step: a host column steps once an interval, with the mean of ``k`` gradients taken with
parameters up to ``2k`` steps old (``k`` without the overlap). ``docs/offload.md`` compares its convergence with the exact run. What is exact is
its bookkeeping: the result equals a plain-PyTorch emulation of the same arithmetic
(``tests/distributed/test_selective_updates.py``), and a checkpoint keeps the interval's sums, the chosen columns, the
step counts and the rows of a host step in flight, by parameter name (``checkpoint/selective_updates.py``), so a
resume at the same world size continues bit for bit, and one at another continues the schedule from the same state
(its column norms are then summed in another order, so near ties may choose other columns). Writes to the parameters
between steps (``ModelPruning``, ``p.data`` edits) are not taken into the masters, as under the delayed update: the
next landing or device step writes over them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.offload.worker import HostStepWorker, PendingUpdate

#: Rows of the host step are taken this many elements at a time: torch's elementwise ops each pass over their
#: operands, and over a tile that stays in cache those passes cost the cache's bandwidth, not the memory's
#: (``benchmarks/bench_host_step.py``'s ``selective`` row).
HOST_TILE_ELEMENTS = 2**17


@dataclasses.dataclass(frozen=True)
class SelectiveSettings:
    """``ZeroStrategy(offload_update_interval=..., offload_topk_ratio=..., offload_select_interval=...)``, resolved."""

    update_interval: int
    topk_ratio: float
    select_interval: int
    overlap_step: bool = True
    """The host step lands an interval later, overlapping the device's steps; False: at once, the step waiting."""


@dataclasses.dataclass(frozen=True)
class AdamHyper:
    """One param group's Adam settings as a step reads them, taken when the step starts."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    @classmethod
    def of(cls, optimizer: Optimizer, group: Mapping[str, Any]) -> AdamHyper:
        beta1, beta2 = group["betas"]
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
        return cls(
            float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), group["weight_decay"], decoupled
        )

    def coefficients(self, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per column, from its step count (fp64): Adam's step size ``lr / (1 - beta1^t)`` and ``sqrt(1 - beta2^t)``,
        rounded to fp32 once."""
        steps = steps.clamp(min=1)  # a column is counted before it steps; 0 is a device column's unused host copy
        step_size = self.lr / (1 - torch.pow(self.beta1, steps))
        return step_size.float(), (1 - torch.pow(self.beta2, steps)).sqrt().float()

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step_size: torch.Tensor,
        bias_correction2_sqrt: torch.Tensor,
    ) -> None:
        """torch's single-tensor Adam/AdamW, in its order, with the bias corrections per column (broadcast over the
        rows): its last ``param.addcdiv_(exp_avg, denom, value=-step_size)`` takes a scalar step size, so here the
        step is ``param.sub_(exp_avg / denom * step_size)``, which rounds differently."""
        if self.weight_decay:
            if self.decoupled:
                param.mul_(1 - self.lr * self.weight_decay)
            else:
                grad = grad.add(param, alpha=self.weight_decay)
        exp_avg.lerp_(grad, 1 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        param.sub_(exp_avg / denom * step_size)


def step_columns(
    settings: AdamHyper,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step_size: torch.Tensor,
    bias_correction2_sqrt: torch.Tensor,
) -> None:
    """The host's step of one parameter's rows, seen as ``[rows, columns]``, a tile of rows at a time (see
    :data:`HOST_TILE_ELEMENTS`)."""
    columns = step_size.numel()
    tensors = [t.reshape(-1, columns) for t in (master, grad, exp_avg, exp_avg_sq)]
    block = max(1, HOST_TILE_ELEMENTS // columns)
    for start in range(0, tensors[0].shape[0], block):
        rows, grads, first, second = (t[start : start + block] for t in tensors)
        settings.step(rows, grads, first, second, step_size, bias_correction2_sqrt)


def check_optimizer(optimizer: Optimizer) -> None:
    """Selective updates run Adam's arithmetic themselves, per column: refuse what they would not reproduce."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(
            f"ZeroStrategy(offload_update_interval>1) steps columns with Adam's arithmetic and per-column step counts; "
            f"it supports torch.optim.Adam and AdamW, not {type(optimizer).__name__}. Use offload_update_interval=1 "
            "for this optimizer."
        )
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                raise TypeError(
                    f"ZeroStrategy(offload_update_interval>1) does not support {type(optimizer).__name__}({flag}=True)."
                    " Use offload_update_interval=1, or leave it off."
                )


@dataclasses.dataclass(eq=False)
class ColumnBlock:
    """Some columns of one parameter held on the device: their fp32 masters and Adam's moments, ``[rows, columns]``."""

    columns: torch.Tensor
    """Long indices, on the host; ``on_device`` the same on the device."""
    on_device: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def select(self, keep: torch.Tensor) -> ColumnBlock:
        """The block of the columns at positions ``keep`` (a bool mask over :attr:`columns`)."""
        at = keep.nonzero().view(-1)
        on_device = at.to(self.master.device)
        return ColumnBlock(
            self.columns[at],
            self.on_device.index_select(0, on_device),
            *(t.index_select(1, on_device) for t in (self.master, self.exp_avg, self.exp_avg_sq)),
        )


@dataclasses.dataclass(eq=False)
class SelectiveParam:
    """One parameter's selective state on this rank: its columns, their step counts and which are on the device, the
    device's block of them, and the host's sums of the interval's gradients."""

    index: int
    """The engine's trainable parameter index."""
    name: str
    columns: int
    selectable: bool
    """Two or more dimensions: its columns are chosen; else it is one column, always on the device."""
    device: torch.device
    column_steps: torch.Tensor
    """fp64 ``[columns]`` on the host, the same on every rank: Adam steps each column took."""
    selected: torch.Tensor
    """bool ``[columns]`` on the host, the same on every rank."""
    chosen: ColumnBlock | None = None
    """The selected columns, stepped on the device every step."""
    leaving: ColumnBlock | None = None
    """Columns a choice took off the device just before a host step that does not step them started: they wait here,
    unchanged, until it lands (it writes over their host copies), then go to the host masters and state (see [Note:
    selective updates])."""
    previous: torch.Tensor | None = None
    """The selection before a choice made at this step (its host step steps the columns neither selects)."""
    sums: list[torch.Tensor | None] = dataclasses.field(default_factory=lambda: [None, None])
    """Two host buffers of this rank's rows: the interval's gradient sum, and the one a host step in flight reads."""
    filled: list[bool] = dataclasses.field(default_factory=lambda: [False, False])
    """Whether some step of the buffer's interval gave this parameter a gradient."""

    @staticmethod
    def columns_of(shape: torch.Size) -> int:
        return math.prod(shape[1:]) if len(shape) >= 2 else 1

    def as_columns(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(-1, self.columns)

    def write_into(self, resident: torch.Tensor) -> None:
        """The device's columns (and those leaving) into the rows forward computes with."""
        rows = self.as_columns(resident)
        for block in (self.chosen, self.leaving):
            if block is not None and rows.numel():
                rows.index_copy_(1, block.on_device, block.master.to(rows.dtype))


class SelectiveUpdates:
    """The selective schedule of one optimizer (see [Note: selective updates])."""

    def __init__(
        self,
        optimizer: Optimizer,
        settings: SelectiveSettings,
        params: Sequence[SelectiveParam],
        worker: HostStepWorker,
        *,
        group: dist.ProcessGroup | None,
        shard_of: Callable[[int], torch.Tensor],
        resident_rows: Callable[[int], torch.Tensor],
        masters_into_resident: Callable[[Sequence[int]], torch.Event | None],
    ) -> None:
        check_optimizer(optimizer)
        self.optimizer = optimizer
        self.settings = settings
        self.params = {p.index: p for p in params}
        self.worker = worker
        self.group = group
        self.bind(shard_of, resident_rows, masters_into_resident)
        #: What the next host step waits for before it writes the masters: the copies of them a landing queued.
        self._copies: torch.Event | None = None
        #: Selective steps taken; where in its interval and selection the next one is.
        self.steps_taken = 0
        #: The host step in flight, and the step index it lands at.
        self.pending: PendingUpdate | None = None
        self.lands_at: int | None = None
        #: The host masters and state hold every column (written back since the device's last change).
        self._host_current = False

    def bind(
        self,
        shard_of: Callable[[int], torch.Tensor],
        resident_rows: Callable[[int], torch.Tensor],
        masters_into_resident: Callable[[Sequence[int]], torch.Event | None],
    ) -> None:
        """The engine's view of its parameters, by index: the host master (the tensor the optimizer keys its state
        by), this rank's rows of the parameter forward computes with, and the copy of host masters into those (the
        event behind it, where it is asynchronous). Bound again when the layout grows (``rekey``)."""
        self._shard_of = shard_of
        self._resident_rows = resident_rows
        self._masters_into_resident = masters_into_resident

    def rekey(self, moved: Mapping[int, int]) -> SelectiveUpdates:
        """The layout grew (parameters unfrozen during ``fit``): parameter ``i`` is now ``moved[i]``. The caller wrote
        the device's columns back first (the host masters are the same tensors)."""
        params: dict[int, SelectiveParam] = {}
        for index, param in self.params.items():
            if index in moved:
                param.index = moved[index]
                params[param.index] = param
        self.params = params
        return self

    def adopt(self, param: SelectiveParam) -> None:
        """A parameter that joins after the first step (a param group added during ``fit``): its columns start on the
        host but for one of a parameter of fewer dimensions, which goes to the device; the next choice includes it."""
        self.params[param.index] = param
        if self.steps_taken:
            self._pull(param)
            param.previous = param.selected.clone()

    # ------------------------------------------------------------------ state on the host
    def host_state(self, index: int) -> dict[str, torch.Tensor]:
        """The optimizer's state of parameter ``index``'s host master (made at the first step, as torch's Adam makes
        it: fp32 zeros beside a ``step`` count; here the count is the largest column's)."""
        shard = self._shard_of(index)
        state: dict[str, torch.Tensor] = self.optimizer.state[shard]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(shard, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(shard, memory_format=torch.preserve_format)
        return state

    def _host_tensors(self, param: SelectiveParam) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The host master and moments of ``param``, seen as ``[rows, columns]``."""
        state = self.host_state(param.index)
        host = (self._shard_of(param.index), state["exp_avg"], state["exp_avg_sq"])
        return param.as_columns(host[0]), param.as_columns(host[1]), param.as_columns(host[2])

    # ------------------------------------------------------------------ one step
    def step(self, grads: Mapping[int, torch.Tensor | None], hyper: Mapping[int, AdamHyper]) -> None:
        """One optimizer step: ``grads`` are this rank's final host gradients by index (None: none this step),
        ``hyper`` each parameter's group settings; the caller all-gathers the resident rows afterwards."""
        k, s = self.settings.update_interval, self.steps_taken
        self._host_current = False
        if s == 0:
            self._continue_counts()
            self._choose(grads)
            for param in self.params.values():
                self._pull(param)
        buffer = (s // k) % 2
        for index, param in self.params.items():
            grad = grads.get(index)
            if grad is None:
                continue
            self._device_step(param, grad, hyper[index])
            total = param.sums[buffer]
            if total is None:
                total = param.sums[buffer] = torch.empty_like(grad, dtype=torch.float32)
            if param.filled[buffer]:
                total.add_(grad)
            else:
                total.copy_(grad)
                param.filled[buffer] = True
        if s % k == k - 1:
            if self.lands_at == s:
                self.land()
            if (s + 1) % self.settings.select_interval == 0:
                self._choose_again(grads, hyper, buffer)
            self._start_host_step(buffer, hyper)
            self.lands_at = None if self.pending is None else s + k if self.settings.overlap_step else s
            if self.lands_at == s:
                self.land()
        self.steps_taken = s + 1

    def _device_step(self, param: SelectiveParam, grad: torch.Tensor, hyper: AdamHyper) -> None:
        block = param.chosen
        if block is None:
            return
        param.column_steps[block.columns] += 1
        device_grad = param.as_columns(grad).index_select(1, block.columns).to(param.device, dtype=torch.float32)
        with torch.no_grad():
            self._adam_on_device(param, block, device_grad, hyper)
            param.write_into(self._resident_rows(param.index))

    @staticmethod
    def _adam_on_device(param: SelectiveParam, block: ColumnBlock, grad: torch.Tensor, hyper: AdamHyper) -> None:
        step_size, correction = hyper.coefficients(param.column_steps[block.columns])
        hyper.step(
            block.master,
            grad,
            block.exp_avg,
            block.exp_avg_sq,
            step_size.to(param.device),
            correction.to(param.device),
        )

    def _start_host_step(self, buffer: int, hyper: Mapping[int, AdamHyper]) -> None:
        """Step every column of the parameters with a gradient this interval, with the interval's mean gradient, in
        the worker; the columns this host step is for (on the host this interval and the next) advance their counts
        now, so the host step reads fixed copies."""
        k = self.settings.update_interval
        work: list[
            tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], AdamHyper, torch.Tensor, torch.Tensor]
        ] = []
        for index, param in self.params.items():
            total, previous = param.sums[buffer], param.previous
            param.previous = None
            if not param.filled[buffer] or total is None:
                if param.leaving is not None:  # no host step writes over its host copies: they go there now
                    self._write_back(param, param.leaving)
                    param.leaving = None
                continue
            param.filled[buffer] = False
            if param.selectable:
                stepped = ~param.selected if previous is None else ~(param.selected | previous)
                param.column_steps[stepped] += 1
            step_size, correction = hyper[index].coefficients(param.column_steps.clone())
            work.append((self._shard_of(index), total, self.host_state(index), hyper[index], step_size, correction))

        after, self._copies = self._copies, None

        def host_step() -> None:
            if after is not None:  # the landing's copies of these masters to the device
                after.synchronize()
            with torch.no_grad():
                for shard, total, state, settings, step_size, correction in work:
                    mean = total.div_(k)
                    step_columns(settings, shard, mean, state["exp_avg"], state["exp_avg_sq"], step_size, correction)

        self.pending = self.worker.start(host_step) if work else None

    def land(self) -> bool:
        """The host step in flight lands: its rows go to the resident parameters, the device's columns over them,
        and the columns that left the device go to the host (at its step, and at the end of training); the caller
        all-gathers them. False: none was in flight."""
        if self.pending is None:
            return False
        self.pending.wait()
        self.pending, self.lands_at = None, None
        self._copies = self._masters_into_resident(list(self.params))
        for param in self.params.values():
            param.write_into(self._resident_rows(param.index))
            if param.leaving is not None:
                self._write_back(param, param.leaving)
                param.leaving = None
        return True

    def _continue_counts(self) -> None:
        """A run that took exact steps before (a checkpoint of one) continues each column's count from its own."""
        for param in self.params.values():
            state = self.optimizer.state.get(self._shard_of(param.index), {})
            if "step" in state and not bool(param.column_steps.any()):
                param.column_steps.fill_(float(state["step"]))

    # ------------------------------------------------------------------ choosing columns
    def _choose(self, grads: Mapping[int, torch.Tensor | None]) -> None:
        """Collective over the sharding group: mark every parameter's columns from this step's gradient norms
        (all-reduced, so every rank chooses the same)."""
        selectable = [p for p in self.params.values() if p.selectable]
        if not selectable:
            return
        norms = torch.cat([self._column_norms(p, grads.get(p.index)) for p in selectable])
        comm = norms.to(selectable[0].device)
        if collectives.is_distributed() and collectives.world_size(self.group) > 1:
            collectives.all_reduce(comm, group=self.group)
        norms = comm.cpu()
        offset = 0
        for param in selectable:
            column_norms = norms[offset : offset + param.columns]
            offset += param.columns
            param.previous = param.selected.clone()
            if grads.get(param.index) is None:
                continue  # no rank gave it a gradient this step: its choice (none, at the first step) stays
            count = min(param.columns, math.ceil(self.settings.topk_ratio * param.columns))
            order = torch.sort(column_norms, descending=True, stable=True).indices[:count]
            param.selected.zero_()
            param.selected[order] = True

    def _choose_again(
        self, grads: Mapping[int, torch.Tensor | None], hyper: Mapping[int, AdamHyper], buffer: int
    ) -> None:
        """At the last step of an interval, its host step not started yet and the one before landed: choose again.
        Columns that stay keep their device state; columns that join come from the host with this interval's mean
        gradient stepped on the device (the host step about to start leaves them out), so they are as current as
        if the host had stepped them; columns that leave wait on the device until that host step lands (it writes
        over their host copies), and go to the host then."""
        self._choose(grads)
        k = self.settings.update_interval
        for param in self.params.values():
            block, previous = param.chosen, param.previous
            if block is None or previous is None or not param.selectable:
                continue
            staying = param.selected[block.columns]
            param.leaving = block.select(~staying) if not bool(staying.all()) else None
            joining = (param.selected & ~previous).nonzero().view(-1)
            total = param.sums[buffer]
            arrived = self._from_host(param, joining)
            if param.filled[buffer] and total is not None and joining.numel():
                param.column_steps[joining] += 1
                mean = param.as_columns(total).index_select(1, joining).div(k)
                with torch.no_grad():
                    self._adam_on_device(param, arrived, mean.to(param.device, dtype=torch.float32), hyper[param.index])
            param.chosen = self._merge(param, block.select(staying), arrived)
            param.write_into(self._resident_rows(param.index))

    def _from_host(self, param: SelectiveParam, columns: torch.Tensor) -> ColumnBlock:
        master, exp_avg, exp_avg_sq = self._host_tensors(param)
        return ColumnBlock(
            columns,
            columns.to(param.device),
            *(t.index_select(1, columns).to(param.device, dtype=torch.float32) for t in (master, exp_avg, exp_avg_sq)),
        )

    @staticmethod
    def _merge(param: SelectiveParam, first: ColumnBlock, second: ColumnBlock) -> ColumnBlock:
        """One block of both, its columns in increasing order."""
        columns = torch.cat([first.columns, second.columns])
        order = columns.argsort()
        on_device = order.to(param.device)

        def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([a, b], dim=1).index_select(1, on_device)

        return ColumnBlock(
            columns[order],
            joined(first.on_device.view(1, -1), second.on_device.view(1, -1)).view(-1),
            joined(first.master, second.master),
            joined(first.exp_avg, second.exp_avg),
            joined(first.exp_avg_sq, second.exp_avg_sq),
        )

    @staticmethod
    def _column_norms(param: SelectiveParam, grad: torch.Tensor | None) -> torch.Tensor:
        if grad is None or grad.numel() == 0:
            return torch.zeros(param.columns, dtype=torch.float64)
        return param.as_columns(grad).double().square().sum(0)

    def _pull(self, param: SelectiveParam) -> None:
        """Bring the selected columns' masters and moments from the host to the device."""
        param.chosen = self._from_host(param, param.selected.nonzero().view(-1))
        param.previous = None

    def _write_back(self, param: SelectiveParam, block: ColumnBlock) -> None:
        with torch.no_grad():
            for host, device in zip(self._host_tensors(param), (block.master, block.exp_avg, block.exp_avg_sq)):
                host.index_copy_(1, block.columns, device.to("cpu", dtype=host.dtype))

    def write_back(self) -> None:
        """Put the device's columns (and those leaving it) into the host masters and state, which then hold every
        column (before anything reads the optimizer's state); the host step in flight is waited for first. Once per
        step at most: checkpoints ask for every parameter's rows."""
        if self.pending is not None:
            self.pending.wait()
        if self._host_current:
            return
        self._host_current = True
        for param in self.params.values():
            for block in (param.chosen, param.leaving):
                if block is not None:
                    self._write_back(param, block)
            if param.chosen is not None:
                self.host_state(param.index)["step"] = param.column_steps.max().float()

    def pull_all(self) -> None:
        """The host state was loaded (a checkpoint): the device's columns follow it (none before the first step)."""
        if self.steps_taken:
            for param in self.params.values():
                self._pull(param)
                param.leaving = None

    # ------------------------------------------------------------------ checkpoints
    def state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """What a checkpoint keeps beside the optimizer's state, by parameter name (``checkpoint/selective_updates.py``):
        the column counts and choice (the same on every rank), the progress (steps taken, the step the host step in
        flight lands at or -1, whether the interval's sum holds anything) and this rank's rows of the interval's sum."""
        buffer = (self.steps_taken // self.settings.update_interval) % 2
        lands_at = -1 if self.lands_at is None else self.lands_at
        out: dict[str, dict[str, torch.Tensor]] = {}
        for param in self.params.values():
            filled = param.filled[buffer] and param.sums[buffer] is not None
            total = param.sums[buffer] if filled else None
            out[param.name] = {
                "column_steps": param.column_steps.clone(),
                "selected": param.selected.to(torch.int8),
                "progress": torch.tensor(
                    [self.steps_taken, lands_at, int(filled), *self._schedule()], dtype=torch.int64
                ),
                "sums": total.clone() if total is not None else torch.zeros_like(self._shard_of(param.index)),
            }
        return out

    def _schedule(self) -> tuple[int, int, int]:
        """The settings the saved progress means something under."""
        settings = self.settings
        return settings.update_interval, settings.select_interval, int(settings.overlap_step)

    def load_state_by_name(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Restore what :meth:`state_by_name` gave (``sums``: this rank's rows), after the optimizer's state."""
        for param in self.params.values():
            entry = state.get(param.name)
            if entry is None:
                continue
            steps_taken, lands_at, filled, *saved = (int(x) for x in entry["progress"].tolist())
            if tuple(saved) != self._schedule():
                names = ("offload_update_interval", "offload_select_interval", "offload_overlap_step")
                raise ValueError(
                    "This checkpoint was saved mid-schedule by selective updates with "
                    + ", ".join(f"{n}={v}" for n, v in zip(names, saved))
                    + "; this run has "
                    + ", ".join(f"{n}={v}" for n, v in zip(names, self._schedule()))
                    + ". Resume with the saved settings (the interval's sums and the pending host step follow them)."
                )
            self.steps_taken, self.lands_at = steps_taken, None if lands_at < 0 else lands_at
            param.column_steps.copy_(entry["column_steps"])
            param.selected.copy_(entry["selected"].bool())
            buffer = (steps_taken // self.settings.update_interval) % 2
            param.sums, param.filled = [None, None], [False, False]
            if filled:
                shard = self._shard_of(param.index)
                param.sums[buffer] = entry["sums"].to("cpu", dtype=torch.float32).reshape(shard.shape).clone()
                param.filled[buffer] = True
        #: The host step in flight when the checkpoint was saved: the loaded masters hold it.
        self.pending = PendingUpdate() if self.lands_at is not None else None
        self.pull_all()
