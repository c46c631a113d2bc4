"""``stage="auto"``: the configuration the planner chooses for a run, within the settings its user gave.

The planner (``plan.py``) weighs stage x offload share x activation checkpointing x micro-batch, fastest first, and
picks the first predicted to fit the budget. Here that search is narrowed to what the user left open:

* ``offload_optimizer`` given: every candidate offloads exactly that share (``False``: none);
* ``offload_params`` given: with it, only stage 3 with it; without it, no candidate that offloads parameters;
* ``activation_checkpointing`` given: on with that policy (``None``: off); else on or off, with the model's repeated
  block (the class of the first ``nn.ModuleList``'s layers) as the policy;
* ``offload_activations`` given: the checkpointed inputs on the host (or never);
* a batch the strategy cannot split (:func:`splittable`), or sequence parallelism (the batch is cut along the
  sequence before the step): the micro-batch is the user's batch. (Manual optimization is refused before this:
  ``strategy/auto_choice.py``.)

Every other setting is kept as given, and a candidate those settings refuse (``offload_step_delay=1`` needs stage 1
or 2 with the whole optimizer offloaded, say) is not weighed: each candidate is checked by building its
:class:`ZeroConfig`. Nothing here sees a ``Trainer``: ``strategy/auto_choice.py`` gathers the inputs, makes the
ranks agree, and applies the choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.planning.formulas import format_bytes, unit_for
from lightning_zero.planning.plan import (
    CONFIGURATIONS,
    Candidate,
    NothingFits,
    Planner,
    Search,
    activations_label,
    describe,
    format_rows,
)
from lightning_zero.planning.predict import Configuration
from lightning_zero.torch_versions.tracing import tree_leaves

#: The strategy settings ``stage="auto"`` chooses; given ones are kept (see the module docstring).
CHOSEN_SETTINGS = ("stage", "offload_optimizer", "offload_params", "activation_checkpointing", "offload_activations")
#: What only ``stage="auto"`` reads; a chosen configuration has them at their defaults.
AUTO_SETTINGS = {"device_memory": None, "memory_headroom": 0.1}


@dataclasses.dataclass(frozen=True)
class Budget:
    """The memory a choice must fit, as the ranks agreed on it."""

    memory: float
    """Bytes per device, as given (``device_memory``) or read: the smallest over the ranks."""
    headroom: float
    """The share of :attr:`memory` left free (``memory_headroom``)."""
    host: float | None
    """Bytes of host memory per node for what offload puts there; None where the device is the host (a CPU run
    without ``device_memory``): offloading moves nothing out of that memory, so it is not weighed."""
    source: str
    """Where :attr:`memory` comes from, for the table."""

    @property
    def device(self) -> float:
        """What the prediction must stay under."""
        return self.memory * (1 - self.headroom)

    @property
    def host_limit(self) -> float | None:
        return None if self.host is None else self.host * (1 - self.headroom)


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What ``stage="auto"`` chose: the strategy settings, the micro-batch, and the prediction they were chosen by."""

    settings: dict[str, Any]
    """``stage``, ``offload_optimizer``, ``offload_params``, ``offload_activations`` as ZeroStrategy takes them, and
    ``activation_checkpointing`` as a flag (the policy is the user's, or the model's repeated block)."""
    micro_batch: int
    """Samples per micro-batch: the DataLoader's batch, or a divisor of it (the strategy splits each batch)."""
    batch: int
    """Samples per batch the DataLoader gives each rank (the traced sample batch's)."""
    predicted_device: int
    predicted_host: int
    """Bytes per rank the pick holds in host memory (offloaded state, offloaded checkpointed inputs)."""
    memory: float
    headroom: float
    table: str
    """The table printed on rank 0 when it was chosen (empty for a choice read from a checkpoint)."""

    @property
    def splits(self) -> int:
        """Micro-batches each batch is split into inside one training step (1: kept whole)."""
        return self.batch // self.micro_batch

    def record(self) -> dict[str, Any]:
        """The choice in plain types, for a checkpoint (a resumed run reuses it)."""
        return {
            "settings": dict(self.settings),
            "micro_batch": self.micro_batch,
            "batch": self.batch,
            "predicted_device": self.predicted_device,
            "predicted_host": self.predicted_host,
            "memory": self.memory,
            "headroom": self.headroom,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> AutoChoice:
        return cls(
            settings=dict(record["settings"]),
            micro_batch=int(record["micro_batch"]),
            batch=int(record["batch"]),
            predicted_device=int(record["predicted_device"]),
            predicted_host=int(record["predicted_host"]),
            memory=float(record["memory"]),
            headroom=float(record["headroom"]),
            table="",
        )

    def describe(self) -> str:
        """One line: the configuration chosen and its predicted peak."""
        s = self.settings
        offload = s["offload_optimizer"]
        parts = [f"stage {s['stage']}"]
        if s["offload_params"]:
            parts.append("parameters and optimizer offloaded")
        elif offload:
            parts.append("optimizer offloaded" if offload is True else f"{offload:g} of the optimizer offloaded")
        if s["activation_checkpointing"]:
            parts.append("activation checkpointing" + (" (inputs on the host)" if s["offload_activations"] else ""))
        parts.append(f"micro-batch {self.micro_batch} of {self.batch}")
        unit = unit_for(self.memory, self.predicted_device)
        return (
            f"{', '.join(parts)}; predicted peak {format_bytes(self.predicted_device, unit)} per device of "
            f"{format_bytes(self.memory, unit)}"
        )


def splittable(batch: Any) -> bool:
    """Whether the strategy can split ``batch`` into micro-batches: a tensor, or a dict, list or tuple (nested) of
    tensors that all share their first dimension."""
    leaves = tree_leaves(batch)
    if not leaves or not all(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 for leaf in leaves):
        return False
    return len({leaf.shape[0] for leaf in leaves}) == 1 and _plain_containers(batch)


def _plain_containers(batch: Any) -> bool:
    if isinstance(batch, torch.Tensor):
        return True
    if type(batch) in (dict, list, tuple):
        values = batch.values() if isinstance(batch, dict) else batch
        return all(_plain_containers(value) for value in values)
    return False


def repeated_block(module: nn.Module) -> type[nn.Module] | None:
    """The class of the layers of the module's first non-empty ``nn.ModuleList`` (a transformer's blocks): what
    activation checkpointing wraps when the user names nothing."""
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub):
            return type(sub[0])
    return None


def choose(
    planner: Planner,
    budget: Budget,
    arguments: Mapping[str, Any],
    given: Collection[str],
    *,
    split: bool,
) -> AutoChoice:
    """The fastest configuration predicted to fit ``budget``, keeping the ``given`` settings of ``arguments`` (the
    strategy's, with ``stage="auto"``); ``split``: micro-batches smaller than the batch may be chosen. Raises
    :class:`~lightning_zero.planning.plan.NothingFits` naming the smallest candidate and by how much it misses."""
    configurations = _configurations(arguments, given, budget.host is not None)
    if not configurations:
        raise ZeroConfigError(
            "`stage='auto'`: the settings given leave no stage to choose from ("
            + ", ".join(f"{name}={arguments[name]!r}" for name in sorted(given) if name in CHOSEN_SETTINGS)
            + "); drop one, or name a stage."
        )
    checkpointing = _checkpointing_choices(planner, arguments, given, budget.host is not None)
    micro_batches = None if split else [planner.per_device]
    fill = "offload_optimizer" not in given
    try:
        search = planner.search(
            budget.device,
            budget.host_limit,
            configurations=configurations,
            checkpointing=checkpointing,
            micro_batches=micro_batches,
            fill_shares=fill,
        )
    except NothingFits as err:
        raise NothingFits(
            f"`stage='auto'` found no configuration for {format_bytes(budget.memory)} per device ({budget.source}, "
            f"less {budget.headroom:.0%} headroom). {err}"
        ) from None  # two sentences, each in its own unit
    pick = search.pick
    settings = _settings(pick)
    return AutoChoice(
        settings=settings,
        micro_batch=pick.micro_batch,
        batch=planner.per_device,
        predicted_device=pick.prediction.device_bytes,
        predicted_host=pick.prediction.host_bytes,
        memory=budget.memory,
        headroom=budget.headroom,
        table=_table(search, budget, planner.devices_per_host),
    )


def _configurations(arguments: Mapping[str, Any], given: Collection[str], offload: bool) -> list[Configuration]:
    """The candidates' stage and offload, narrowed by what was given and by what the other settings accept."""
    share = arguments["offload_optimizer"]
    pinned = 1.0 if share is True else float(share or 0.0)
    kept = []
    for configuration in CONFIGURATIONS:
        if "offload_optimizer" in given:
            if bool(configuration.offload_optimizer) != bool(pinned):
                continue
            configuration = dataclasses.replace(configuration, offload_optimizer=pinned)
        elif configuration.offload_optimizer and not offload:
            continue
        if "offload_params" in given and configuration.offload_params != arguments["offload_params"]:
            continue
        if configuration in kept or not _accepted(arguments, configuration):
            continue
        kept.append(configuration)
    return kept


def _accepted(arguments: Mapping[str, Any], configuration: Configuration) -> bool:
    settings = {**arguments, **AUTO_SETTINGS, **_offload_settings(configuration), "stage": configuration.stage}
    try:
        ZeroConfig(**settings)
    except ZeroConfigError:
        return False
    return True


def _offload_settings(configuration: Configuration) -> dict[str, Any]:
    share = configuration.offload_optimizer
    return {
        "offload_optimizer": True if share >= 1 else (float(share) if share else False),
        "offload_params": configuration.offload_params,
    }


def _checkpointing_choices(
    planner: Planner, arguments: Mapping[str, Any], given: Collection[str], offload: bool
) -> list[tuple[bool, bool]]:
    """(checkpointing, its inputs offloaded) choices: the given ones, else every one the model offers."""
    if "activation_checkpointing" in given:
        on = arguments["activation_checkpointing"] is not None
        choices = [(True, False), (True, True)] if on else [(False, False)]
    else:
        choices = list(planner.checkpointing_choices())
    if "offload_activations" in given:
        choices = [c for c in choices if c[1] == arguments["offload_activations"]]
    elif not offload:
        choices = [c for c in choices if not c[1]]  # the host is the device: nothing leaves it
    return choices


def _settings(pick: Candidate) -> dict[str, Any]:
    return {
        "stage": pick.configuration.stage,
        **_offload_settings(pick.configuration),
        "activation_checkpointing": pick.checkpointing,
        "offload_activations": pick.offloaded,
    }


def _table(search: Search, budget: Budget, devices_per_host: int) -> str:
    """The candidates weighed, by their estimated step time, their predicted peaks, the pick and why."""
    weighed = sorted(search.weighed, key=lambda row: row[0].relative_time)  # stable: the search's order on ties
    candidates = [candidate for candidate, _ in weighed]
    pick = candidates.index(search.pick)
    rows = describe(candidates, devices_per_host, pick)
    unit = unit_for(*(r["device_bytes"] for r in rows), *(r["host_bytes"] for r in rows))  # the budget: its own
    chosen = search.pick
    faster = sum(1 for candidate, fits in weighed if not fits and candidate.relative_time < chosen.relative_time)
    why = (
        f"the fastest predicted to fit {format_bytes(budget.device)} per device ({format_bytes(budget.memory)}, "
        f"{budget.source}, less {budget.headroom:.0%} headroom)"
    )
    if faster:
        why += f"; the {faster} faster candidate{'s' if faster > 1 else ''} above need{'s' if faster == 1 else ''} more"
    return (
        "zero_auto: the configurations weighed, fastest first (by the planner's step-time estimate)\n"
        + format_rows(rows, budget.device, budget.host_limit, unit)
        + f"\nzero_auto chose {chosen.configuration.name}{activations_label(chosen)}, micro-batch "
        f"{chosen.micro_batch} x {chosen.accumulate}: {why}."
    )
