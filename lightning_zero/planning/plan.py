"""The planner: every configuration's predicted peak for this model and batch, and the fastest that fits.

A *candidate* is a configuration (stage, offload share: ``predict.Configuration``), activation checkpointing off, on,
or on with the checkpointed inputs on the host (``offload_activations``), and a micro-batch size that divides the
per-device batch (``accumulate_grad_batches`` grows to keep the global batch). Each needs one traced step per
(micro-batch, checkpointing, offload) triple; traces are cached. ``tiled_compute`` is the user's (it takes the
logits out of a training step's output), never the planner's: the traces run with it as given. So is
``sequence_parallel_size``, which sets how many ranks share a sample and so how many samples a step takes: the
traces are one rank's ``T / k`` of each sequence, its attention over the whole sequence.

Which is fastest is an estimate, stated here so it can be argued with: relative step time is

* 1.0 for stages 1 and 2, 1.12 for stage 3 (measured on an H100 for a 1.34B GPT: benchmarks/results/2026-11-25-h100.md);
* ``+ 2.74 r`` for a share ``r`` of the optimizer offloaded (stage 2 + full offload ran at 3.74x there);
* ``x 4/3`` with activation checkpointing (one more forward of the checkpointed blocks);
* ``x 1.05`` more with the checkpointed inputs offloaded (copies on their own stream, beside compute, one block ahead:
  an estimate no GPU has measured yet);
* ``x (1 + 0.1 log2(b / m))`` for micro-batch ``m`` of a per-device batch ``b`` (smaller kernels, more steps).

Offload shares are chosen to fill the budget: the device peak is linear in the share, so the smallest share (in
steps of 0.05) whose peak fits is taken, as DeepSpeed's Twin-Flow ``ratio`` is meant to be used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_zero.planning.formulas import format_bytes, unit_for
from lightning_zero.planning.predict import Configuration, Prediction, predict
from lightning_zero.planning.trace import StepTrace, on_the_line, trace_step
from lightning_zero.torch_versions.tracing import tree_map_only

STAGE_COST = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.12}
OFFLOAD_COST = 2.74
CHECKPOINTING_COST = 4 / 3
ACTIVATION_OFFLOAD_COST = 1.05
MICRO_BATCH_COST = 0.1
#: The configurations the planner weighs, before offload shares are fitted to the budget.
CONFIGURATIONS = (
    Configuration(1),
    Configuration(2),
    Configuration(3),
    Configuration(1, offload_optimizer=1.0),
    Configuration(2, offload_optimizer=1.0),
    Configuration(3, offload_optimizer=1.0),
    Configuration(3, offload_optimizer=1.0, offload_params=True),
)


def relative_time(configuration: Configuration, checkpointing: bool, offloaded: bool, accumulate: int) -> float:
    """The step-time estimate of the module docstring, relative to stage 1 at the whole batch (``accumulate``:
    micro-batches per optimizer step)."""
    share = 1.0 if configuration.offload_params else configuration.offload_optimizer
    time = STAGE_COST[configuration.stage] + OFFLOAD_COST * share
    if checkpointing:
        time *= CHECKPOINTING_COST
    if offloaded:
        time *= ACTIVATION_OFFLOAD_COST
    return time * (1 + MICRO_BATCH_COST * math.log2(accumulate))


#: The offload shares the fill steps through (DeepSpeed's Twin-Flow ``ratio`` in twentieths).
OFFLOAD_SHARE_STEP = 0.05


class MicroBatchFails(Exception):
    """The module's step fails at a micro-batch smaller than the batch: a candidate that cannot run."""


class NothingFits(ValueError):
    """No configuration fits the budget; the message gives the smallest peak found and what would fit it."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    prediction: Prediction
    checkpointing: bool
    micro_batch: int
    accumulate: int
    offloaded: bool = False
    """The checkpointed inputs are kept on the host (``offload_activations``)."""
    tiled_compute: bool | int = False
    """The user's ``tiled_compute``, which the traces ran with."""
    sequence_parallel_size: int = 1
    """The user's ``sequence_parallel_size``, which the traces ran with."""

    @property
    def configuration(self) -> Configuration:
        return self.prediction.configuration

    @property
    def relative_time(self) -> float:
        return relative_time(self.configuration, self.checkpointing, self.offloaded, self.accumulate)

    def fits(self, device_bytes: float, host_bytes: float | None, devices_per_host: int) -> bool:
        p = self.prediction
        return p.device_bytes <= device_bytes and (host_bytes is None or p.host_bytes * devices_per_host <= host_bytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    table: list[Candidate]
    """Every configuration with checkpointing off and on, at the full per-device batch."""
    pick: Candidate | None
    memory_per_device: float | None
    memory_per_host: float | None


@dataclasses.dataclass(frozen=True)
class Search:
    pick: Candidate
    """The fastest candidate predicted to fit."""
    weighed: list[tuple[Candidate, bool]]
    """Every candidate the search weighed, in the order weighed (by the least time each could take), and whether it
    fits: none that fits is faster than the pick."""


class Planner:
    """Traces (cached) and predictions for one module and batch on ``world_size`` ranks."""

    def __init__(
        self,
        build: Callable[[], Any],
        batch: Any,
        *,
        world_size: int,
        precision: str = "32-true",
        accumulate: int = 1,
        checkpointing: Any = None,
        devices_per_host: int | None = None,
        bucket_size_mb: float = 25.0,
        unit_size_mb: float = 100.0,
        backend: str = "nccl",
        optimizer_state_dtype: str = "fp32",
        clipped: bool = False,
        tiled_compute: bool | int = False,
        sequence_parallel_size: int = 1,
    ) -> None:
        self.build, self.batch, self.world_size, self.precision = build, batch, world_size, precision
        #: Every configuration holds the optimizer's state so (an inexact choice is the user's, never the plan's).
        self.optimizer_state_dtype = optimizer_state_dtype
        #: The run clips by the global norm (``gradient_clip_val``): see ``predict``.
        self.clipped = clipped
        #: The process-group backend of the planned run (``"gloo"``: a CPU run, see ``predict``).
        self.backend = backend
        self.accumulate = accumulate
        #: The policy activation checkpointing would use (None: the model offers none, and it is not weighed).
        self.checkpointing = checkpointing
        #: ``ZeroStrategy(tiled_compute=...)`` as the run sets it: every trace runs with it.
        self.tiled_compute = tiled_compute
        #: ``ZeroStrategy(sequence_parallel_size=...)`` as the run sets it: ``batch`` is a data-parallel replica's,
        #: whole sequences, and every trace is one rank's part of them.
        self.sequence_parallel_size = sequence_parallel_size
        self.devices_per_host = devices_per_host or world_size
        self.bucket_size_mb = bucket_size_mb
        #: ``ZeroStrategy(unit_size_mb=...)``: how many layers stage 3 gathers at once.
        self.unit_size_mb = unit_size_mb
        self.per_device = _batch_size(batch)
        self._traces: dict[tuple[int, bool, bool], StepTrace] = {}
        #: Optimizer-state elements per trainable element, from the first trace (one optimizer step, the same for all).
        self._state_per_element: float | None = None

    def trace(self, micro_batch: int, checkpointing: bool, offloaded: bool = False) -> StepTrace:
        """The traced step at ``micro_batch`` (cached). A micro-batch between the whole batch and 1 lies on the line
        through those two
        ([Note: micro-batches on a line]). Raises :class:`MicroBatchFails` where the module's step fails at a
        micro-batch smaller than the batch (``BatchNorm1d`` at one sample): that micro-batch cannot run."""
        key = (micro_batch, checkpointing, offloaded)
        if key not in self._traces:
            anchors = self._anchors()
            if micro_batch not in anchors and len(anchors) == 2:
                line: StepTrace | None = None
                try:
                    high, low = (self.trace(anchor, checkpointing, offloaded) for anchor in anchors)
                    line = on_the_line(high, low, micro_batch)
                except MicroBatchFails:
                    pass  # the step fails at 1 sample: each micro-batch is traced on its own
                if line is not None:
                    self._traces[key] = line
                    return line
            try:
                traced = trace_step(
                    self.build,
                    _micro(self.batch, micro_batch),
                    precision=self.precision,
                    activation_checkpointing=self.checkpointing if checkpointing else None,
                    offload_activations=offloaded,
                    tiled_compute=self.tiled_compute,
                    sequence_parallel_size=self.sequence_parallel_size,
                    state_per_element=self._state_per_element,
                )
            except Exception as err:
                if micro_batch == self.per_device:
                    raise  # the step fails at the batch the run will give it: the user's to see
                raise MicroBatchFails(f"the step fails at {micro_batch} samples: {type(err).__name__}: {err}") from err
            self._traces[key] = traced
            self._state_per_element = traced.state_per_element  # the optimizer's, whatever the batch
        return self._traces[key]

    def _anchors(self) -> tuple[int, ...]:
        """The micro-batches traced for the line: the whole per-device batch and 1, so every other micro-batch lies
        between them (none where the batch has no more than two divisors: each is traced)."""
        divisors = _divisors_descending(self.per_device)
        return (divisors[0], divisors[-1]) if len(divisors) > 2 else ()

    def candidate(
        self, configuration: Configuration, checkpointing: bool, micro_batch: int, offloaded: bool = False
    ) -> Candidate:
        configuration = self._configured(configuration)
        accumulate = self.accumulate * self.per_device // micro_batch
        prediction = predict(
            self.trace(micro_batch, checkpointing, offloaded),
            configuration,
            self.world_size,
            accumulate,
            backend=self.backend,
            clipped=self.clipped,
        )
        return Candidate(
            prediction,
            checkpointing,
            micro_batch,
            accumulate,
            offloaded,
            self.tiled_compute,
            self.sequence_parallel_size,
        )

    def table(self) -> list[Candidate]:
        """Every configuration with checkpointing off and on (the offloaded inputs' rows join only as a pick)."""
        return [
            self.candidate(c, ac, self.per_device, off)
            for ac, off in self.checkpointing_choices()
            for c in CONFIGURATIONS
            if not off
        ]

    def checkpointing_choices(self) -> tuple[tuple[bool, bool], ...]:
        """(checkpointing, its inputs offloaded): off, on, on with offload, where the model offers a block."""
        return ((False, False), (True, False), (True, True)) if self.checkpointing is not None else ((False, False),)

    def plan(self, memory_per_device: float | None = None, memory_per_host: float | None = None) -> Plan:
        """The table, and the fastest candidate that fits (None without a budget). Raises :class:`NothingFits`."""
        table = self.table()
        if memory_per_device is None:
            return Plan(table, None, None, memory_per_host)
        return Plan(table, self.search(memory_per_device, memory_per_host).pick, memory_per_device, memory_per_host)

    def search(
        self,
        memory_per_device: float,
        memory_per_host: float | None = None,
        *,
        configurations: Sequence[Configuration] = CONFIGURATIONS,
        checkpointing: Sequence[tuple[bool, bool]] | None = None,
        micro_batches: Sequence[int] | None = None,
        fill_shares: bool = True,
    ) -> Search:
        """The fastest candidate that fits, weighing the candidates fastest first and tracing only what they need.

        Every (configuration, checkpointing, micro-batch) has a least relative time before any trace (an offloaded
        configuration's at the least share the fill may choose); they are weighed in that order, and the search stops
        at the first whose least time exceeds the best fitting one's. The pick is the one an exhaustive search makes
        (ties go to the earlier configuration, checkpointing choice and micro-batch, in the orders given). Each
        choice may be narrowed (``stage="auto"`` keeps the settings a user gave); ``fill_shares=False`` keeps each
        configuration's offload share as it is (a share the user gave). Raises :class:`NothingFits`."""
        choices = tuple(checkpointing) if checkpointing is not None else self.checkpointing_choices()
        micros = list(micro_batches) if micro_batches is not None else _divisors_descending(self.per_device)
        if not (configurations and choices and micros):
            raise ValueError("the planner's search needs a configuration, a checkpointing choice and a micro-batch")
        first = self.trace(micros[0], *choices[0])  # the fastest candidate's, needed first whatever the budget
        bare = dataclasses.replace(first, timeline=((0, 0),), stage3_timeline=None, offloaded_host_bytes=0)
        options = []
        for ci, configuration in enumerate(configurations):
            for mi, micro in enumerate(micros):
                share = self._least_share(bare, configuration, micro, memory_per_device, memory_per_host, fill_shares)
                if share is None:
                    continue  # its model state alone is over the budget: no trace needed to know it does not fit
                least = dataclasses.replace(configuration, offload_optimizer=share)
                for ki, (ck, off) in enumerate(choices):
                    bound = relative_time(least, ck, off, self.accumulate * self.per_device // micro)
                    options.append((bound, (ci, ki, mi), configuration, ck, off, micro))
        options.sort(key=lambda option: option[:2])
        weighed: list[tuple[Candidate, bool]] = []
        fitting: list[tuple[float, tuple, Candidate]] = []
        for bound, order, configuration, ck, off, micro in options:
            if fitting and bound > min(fitting)[0]:
                break
            try:
                candidate, fits = self._fill(
                    configuration, ck, off, micro, memory_per_device, memory_per_host, fill_shares
                )
            except MicroBatchFails:
                continue  # the module's step cannot run at this micro-batch
            if candidate is None:
                continue  # the same without offload fits too, and is faster: weighed on its own
            weighed.append((candidate, fits))
            if fits:
                fitting.append((candidate.relative_time, order, candidate))
        if not fitting:
            raise NothingFits(
                _nothing_fits(self, memory_per_device, memory_per_host, configurations, choices, min(micros))
            )
        return Search(min(fitting, key=lambda f: f[:2])[2], weighed)

    def _least_share(
        self, bare: StepTrace, configuration: Configuration, micro: int, device: float, host: float | None, fill: bool
    ) -> float | None:
        """The least offload share the fill could choose for ``configuration`` at ``micro``, by its peak without any
        activation (model state, and the gradients and gathered units it holds whatever the step computes); None
        where even that floor does not fit. Every traced step reaches the floor, so the share is a lower bound of the
        fill's and a configuration over it can be skipped untraced: the pick stays the one every candidate weighed
        would give. ``bare``: a trace (its parameters and layers are every trace's) without any activation."""
        accumulate = self.accumulate * self.per_device // micro

        def floor(share: float) -> Prediction:
            offloaded = dataclasses.replace(configuration, offload_optimizer=share)
            return predict(
                bare,
                self._configured(offloaded),
                self.world_size,
                accumulate,
                backend=self.backend,
                clipped=self.clipped,
            )

        def fits(prediction: Prediction) -> bool:
            host_bytes = prediction.host_bytes * self.devices_per_host
            return prediction.device_bytes <= device and (host is None or host_bytes <= host)

        given = floor(configuration.offload_optimizer)
        if not fits(given):
            return None
        if not fill or configuration.offload_optimizer < 1 or configuration.offload_params:
            return configuration.offload_optimizer
        steps = round(1 / OFFLOAD_SHARE_STEP)  # the fill's shares: 0.05, 0.1, ... 1.0
        return next(share for share in (k / steps for k in range(1, steps + 1)) if fits(floor(share)))

    def _configured(self, configuration: Configuration) -> Configuration:
        """``configuration`` with this run's bucket, unit and optimizer-state settings."""
        return dataclasses.replace(
            configuration,
            bucket_size_mb=self.bucket_size_mb,
            unit_size_mb=self.unit_size_mb,
            optimizer_state_dtype=self.optimizer_state_dtype,
        )

    def _fill(
        self,
        configuration: Configuration,
        checkpointing: bool,
        offloaded: bool,
        micro: int,
        device: float,
        host: float | None,
        fill_shares: bool = True,
    ) -> tuple[Candidate | None, bool]:
        """The candidate at this micro-batch, its offload share lowered to the least that fits (if offloading), and
        whether it fits; (None, True) where the configuration without offload fits too (it is weighed on its own)."""
        full = self.candidate(configuration, checkpointing, micro, offloaded)
        if not full.fits(device, host, self.devices_per_host):
            return full, False
        if not fill_shares or configuration.offload_optimizer < 1 or configuration.offload_params:
            return full, True
        none = self.candidate(
            dataclasses.replace(configuration, offload_optimizer=0.0), checkpointing, micro, offloaded
        )
        if none.fits(device, host, self.devices_per_host):
            return None, True
        saved = none.prediction.device_bytes - full.prediction.device_bytes
        needed = none.prediction.device_bytes - device
        steps = round(1 / OFFLOAD_SHARE_STEP)
        share = min(1.0, math.ceil(steps * needed / saved) / steps) if saved > 0 else 1.0
        while share < 1.0:
            partial = self.candidate(
                dataclasses.replace(configuration, offload_optimizer=share), checkpointing, micro, offloaded
            )
            if partial.fits(device, host, self.devices_per_host):
                return partial, True
            share = round(share + OFFLOAD_SHARE_STEP, 2)
        return full, True


def _nothing_fits(
    planner: Planner,
    device: float,
    host: float | None,
    configurations: Sequence[Configuration],
    choices: Sequence[tuple[bool, bool]],
    micro: int,
) -> str:
    """The refusal: the least any candidate needs (the smallest micro-batch, every configuration) and what would
    help."""
    candidates = []
    for size in sorted({micro, planner.per_device}):  # the smallest micro-batch the step runs at
        try:
            candidates = [planner.candidate(c, ac, size, off) for c in configurations for ac, off in choices]
        except MicroBatchFails:
            continue
        micro = size
        break
    smallest = min(candidates, key=lambda c: c.prediction.device_bytes)
    peak, host_peak = smallest.prediction.device_bytes, smallest.prediction.host_bytes * planner.devices_per_host
    over_device = peak > device or host is None
    # One unit for the sentence; the host's budget is named only where it is what the smallest candidate misses.
    unit = unit_for(device, peak, host_peak, *([] if over_device or host is None else [host]))
    short = peak - device if over_device else host_peak - (host or 0.0)
    return (
        f"Nothing fits in {format_bytes(device, unit)} per device"
        + ("" if over_device or host is None else f" and {format_bytes(host, unit)} per host")
        + f": the smallest predicted peak is {format_bytes(peak, unit)} per device "
        f"({smallest.configuration.name}{activations_label(smallest)}, micro-batch {micro}"
        f", {format_bytes(host_peak, unit)} per host), {format_bytes(short, unit)} too much "
        f"{'per device' if over_device else 'per host'}. More devices (the sharded state divides by them), a larger "
        "device, a smaller batch or a smaller model (fewer layers) would fit."
    )


def activations_label(candidate: Candidate) -> str:
    """How the candidate keeps its activations, for a sentence (empty when it keeps them all)."""
    if not candidate.checkpointing:
        return ""
    return ", activation checkpointing" + (" (inputs on the host)" if candidate.offloaded else "")


def _divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _batch_size(batch: Any) -> int:
    sizes: list[int] = []
    tree_map_only(torch.Tensor, lambda t: sizes.append(t.shape[0]), batch)
    if not sizes:
        raise ValueError("the sample batch holds no tensor with a batch dimension")
    return sizes[0]


def _micro(batch: Any, size: int) -> Any:
    """The first ``size`` samples of ``batch``."""
    return tree_map_only(torch.Tensor, lambda t: t[:size], batch)


def with_pick(plan: Plan) -> tuple[list[Candidate], int | None]:
    """The table as the user reads it, with the pick in it, and the pick's index (None without a budget).

    The table holds each configuration at the full per-device batch and offload share; the pick may use a smaller
    micro-batch or share. Then it goes in as a row of its own, right after the row it was derived from (same
    stage, offload kind and checkpointing), so the printed table and the plot both show what was chosen."""
    rows = list(plan.table)
    if plan.pick is None:
        return rows, None
    same = [i for i, row in enumerate(rows) if _key(row) == _key(plan.pick)]
    if same:
        return rows, same[0]
    parent = _kind(plan.pick)
    after = max((i for i, row in enumerate(rows) if _kind(row) == parent), default=len(rows) - 1)
    rows.insert(after + 1, plan.pick)
    return rows, after + 1


def _key(candidate: Candidate) -> tuple:
    return candidate.configuration, candidate.checkpointing, candidate.offloaded, candidate.micro_batch


def _kind(candidate: Candidate) -> tuple:
    c = candidate.configuration
    return c.stage, c.offload_params, c.offload_optimizer > 0, candidate.checkpointing, candidate.offloaded


def describe(candidates: Sequence[Candidate], devices_per_host: int, pick: int | None = None) -> list[dict]:
    """Rows for printing and plotting; ``pick`` is the index of the chosen row (``with_pick``)."""
    return [
        {
            "configuration": c.configuration.name,
            "checkpointing": c.checkpointing,
            "offload_activations": c.offloaded,
            "micro_batch": c.micro_batch,
            "accumulate": c.accumulate,
            "device_bytes": c.prediction.device_bytes,
            "host_bytes": c.prediction.host_bytes * devices_per_host,
            "pick": i == pick,
            **c.prediction.breakdown,
        }
        for i, c in enumerate(candidates)
    ]


#: How the printed table marks the pick.
PICK = "<- pick"


def _checkpointing_cell(row: dict) -> str:
    """``no``, ``yes``, or ``yes, host`` (the checkpointed inputs offloaded)."""
    return ("yes, host" if row.get("offload_activations") else "yes") if row["checkpointing"] else "no"


def format_rows(rows: list[dict], budget: float | None, host_budget: float | None, unit: tuple[str, float]) -> str:
    """The table in ``unit`` (one for the whole output); ``micro-batch`` is ``per micro-batch x accumulated``."""
    name, scale = unit
    lines = [
        f"{'configuration':<28}{'checkpointing':>14}{'micro-batch':>13}{'device_' + name:>14}{'host_' + name:>12}"
        + (f"{'fits':>6}" if budget is not None else "")
    ]
    for r in rows:
        line = (
            f"{r['configuration']:<28}{_checkpointing_cell(r):>14}"
            f"{str(r['micro_batch']) + ' x ' + str(r['accumulate']):>13}"
            f"{r['device_bytes'] / scale:>14.2f}{r['host_bytes'] / scale:>12.2f}"
        )
        if budget is not None:
            fits = r["device_bytes"] <= budget and (host_budget is None or r["host_bytes"] <= host_budget)
            line += f"{'yes' if fits else 'no':>6}"
        if r.get("pick"):
            line += f"  {PICK}"
        lines.append(line)
    return "\n".join(lines)
