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
from lightning_zero.planning.trace import StepTrace, trace_step
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
        c = self.configuration
        share = 1.0 if c.offload_params else c.offload_optimizer
        time = STAGE_COST[c.stage] + OFFLOAD_COST * share
        if self.checkpointing:
            time *= CHECKPOINTING_COST
        if self.offloaded:
            time *= ACTIVATION_OFFLOAD_COST
        batch = self.micro_batch * self.accumulate
        return time * (1 + MICRO_BATCH_COST * math.log2(batch / self.micro_batch))

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
        self.per_device = _batch_size(batch)
        self._traces: dict[tuple[int, bool, bool], StepTrace] = {}

    def trace(self, micro_batch: int, checkpointing: bool, offloaded: bool = False) -> StepTrace:
        key = (micro_batch, checkpointing, offloaded)
        if key not in self._traces:
            self._traces[key] = trace_step(
                self.build,
                _micro(self.batch, micro_batch),
                precision=self.precision,
                activation_checkpointing=self.checkpointing if checkpointing else None,
                offload_activations=offloaded,
                tiled_compute=self.tiled_compute,
                sequence_parallel_size=self.sequence_parallel_size,
            )
        return self._traces[key]

    def candidate(
        self, configuration: Configuration, checkpointing: bool, micro_batch: int, offloaded: bool = False
    ) -> Candidate:
        configuration = dataclasses.replace(
            configuration, bucket_size_mb=self.bucket_size_mb, optimizer_state_dtype=self.optimizer_state_dtype
        )
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
            for ac, off in self._checkpointing_choices()
            for c in CONFIGURATIONS
            if not off
        ]

    def _checkpointing_choices(self) -> tuple[tuple[bool, bool], ...]:
        """(checkpointing, its inputs offloaded): off, on, on with offload, where the model offers a block."""
        return ((False, False), (True, False), (True, True)) if self.checkpointing is not None else ((False, False),)

    def plan(self, memory_per_device: float | None = None, memory_per_host: float | None = None) -> Plan:
        """The table, and the fastest candidate that fits (None without a budget). Raises :class:`NothingFits`."""
        table = self.table()
        if memory_per_device is None:
            return Plan(table, None, None, memory_per_host)
        fitting = []
        for configuration in CONFIGURATIONS:
            found = None
            for checkpointing, offloaded in self._checkpointing_choices():
                if offloaded and found is not None and found.micro_batch == self.per_device:
                    if not found.configuration.offload_optimizer and not found.configuration.offload_params:
                        continue  # checkpointing alone fits the whole batch unoffloaded: offloading more only costs
                found = self._fastest_fitting(
                    configuration, checkpointing, offloaded, memory_per_device, memory_per_host
                )
                if found is not None:
                    fitting.append(found)
        if not fitting:
            raise NothingFits(_nothing_fits(self, memory_per_device, memory_per_host))
        pick = min(fitting, key=lambda c: c.relative_time)
        return Plan(table, pick, memory_per_device, memory_per_host)

    def _fastest_fitting(
        self, configuration: Configuration, checkpointing: bool, offloaded: bool, device: float, host: float | None
    ):
        """Over the micro-batches that divide the per-device batch: the fastest that fits (the largest, unless a
        smaller one lets a smaller offload share fit)."""
        found = [
            self._fill(configuration, checkpointing, offloaded, micro, device, host)
            for micro in _divisors_descending(self.per_device)
        ]
        found = [candidate for candidate in found if candidate is not None]
        return min(found, key=lambda c: c.relative_time) if found else None

    def _fill(
        self,
        configuration: Configuration,
        checkpointing: bool,
        offloaded: bool,
        micro: int,
        device: float,
        host: float | None,
    ):
        """The candidate at this micro-batch, its offload share lowered to the least that fits (if offloading)."""
        full = self.candidate(configuration, checkpointing, micro, offloaded)
        if not full.fits(device, host, self.devices_per_host):
            return None
        if configuration.offload_optimizer < 1 or configuration.offload_params:
            return full
        none = self.candidate(
            dataclasses.replace(configuration, offload_optimizer=0.0), checkpointing, micro, offloaded
        )
        if none.fits(device, host, self.devices_per_host):
            return None  # the configuration without offload fits too, and is faster: it is weighed on its own
        saved = none.prediction.device_bytes - full.prediction.device_bytes
        needed = none.prediction.device_bytes - device
        share = min(1.0, math.ceil(20 * needed / saved) / 20) if saved > 0 else 1.0
        while share < 1.0:
            partial = self.candidate(
                dataclasses.replace(configuration, offload_optimizer=share), checkpointing, micro, offloaded
            )
            if partial.fits(device, host, self.devices_per_host):
                return partial
            share = round(share + 0.05, 2)
        return full


def _nothing_fits(planner: Planner, device: float, host: float | None) -> str:
    """The refusal: the least any candidate needs (micro-batch 1, every configuration) and what would help."""
    smallest = min(
        (planner.candidate(c, ac, 1, off) for c in CONFIGURATIONS for ac, off in planner._checkpointing_choices()),
        key=lambda c: c.prediction.device_bytes,
    )
    peak, host_peak = smallest.prediction.device_bytes, smallest.prediction.host_bytes * planner.devices_per_host
    unit = unit_for(device, host or 0.0, peak, host_peak)
    return (
        f"Nothing fits in {format_bytes(device, unit)} per device"
        + (f" and {format_bytes(host, unit)} per host" if host is not None else "")
        + f": the smallest predicted peak is {format_bytes(peak, unit)} per device "
        f"({smallest.configuration.name}{activations_label(smallest)}, micro-batch 1"
        f", {format_bytes(host_peak, unit)} per host). More devices (the "
        "sharded state divides by them), a larger device, or a smaller model would fit."
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
