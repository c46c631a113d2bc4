"""Model-state memory per device and per host for every ZeRO stage and offload choice.

The ZeRO paper's formulas (Rajbhandari et al., 2020, section 3), as this package realises them: with
``P`` parameters trained by Adam on ``N`` ranks, each parameter costs 16 bytes in all, in fp32 (4 weight,
4 gradient, 8 moments) and under mixed precision (2 weight, 2 gradient, 12 fp32 master and moments).
Stage 1 shards the optimizer's part, stage 2 the gradients too, stage 3 everything. Hybrid sharding
(``shard_size="node"``) shards over a node's ``k`` devices instead of all ``N`` ranks (the same formulas with
``N -> k``) and sends only ``2P/k`` gradient elements per rank across nodes instead of ``2P``; ZeRO++ hpZ
(``secondary_shard_size="node"``) shards like flat stage 3 and adds a node-local copy of the parameters
between forward and backward (``P/k`` in the compute dtype, counted here since it is part of the peak) so
that backward's all-gather stays in the node (``2P`` inter-node elements per rank instead of ``3P``). Offloading the
optimizer moves its fp32 masters, their gradients and Adam's moments to host memory, 16P/N per rank (20P/N with
the delayed update, whose host step reads one gradient shard while the next backward fills another; 24P/N with
selective updates' two interval sums, whose chosen share ``r`` of the columns also keeps its masters and moments on the
device, 12rP/N); the device keeps what forward and backward compute with. ``optimizer_state_dtype="bf16"`` holds
Adam's moments in 4 bytes instead of 8, so every 16 above becomes 12 (Lightning's ``ddp`` keeps its own).
Activations, buffers and temporary buffers are not model state and are not counted. Measured: tests/distributed holds stages 1-3 to these formulas within
2% on a 1M-parameter model, tests/integration/test_monitor.py within 5% on a 30K-parameter one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from lightning_zero.config.memory_size import GIB
from lightning_zero.config.zero_config import DEFAULT_TOPK_RATIO, REGISTERED_STRATEGIES

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
#: Bytes of Adam's two moments per parameter, by ``ZeroStrategy(optimizer_state_dtype=...)``.
MOMENT_BYTES = {"fp32": 8, "bf16": 4}
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Choice:
    """One way to train: a ZeRO stage (0 is plain data parallelism) and what is offloaded."""

    name: str
    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False
    shard_size: str | None = None
    """``"node"``: hybrid sharding over each node's devices."""
    secondary_shard_size: str | None = None
    """``"node"``: hpZ's node-local parameter copy."""
    offload_step_delay: int = 0
    """1: ZeRO-Offload's delayed parameter update, which keeps a second fp32 gradient shard on the host."""
    offload_update_interval: int = 1
    """``k > 1``: selective updates, whose chosen columns keep fp32 masters and moments on the device and whose
    interval sums take two fp32 gradient shards on the host."""
    offload_topk_ratio: float = DEFAULT_TOPK_RATIO

    @property
    def across_nodes(self) -> bool:
        """A choice that only differs from a flat one on several nodes."""
        return self.shard_size is not None or self.secondary_shard_size is not None

    @property
    def offload(self) -> str:
        if self.offload_params:
            return "params+optimizer"
        if not self.offload_optimizer:
            return "-"
        if self.offload_update_interval > 1:
            return f"optimizer, selective k={self.offload_update_interval}"
        return "optimizer, delayed" if self.offload_step_delay else "optimizer"

    def strategy(self) -> dict:
        """The strategy as a LightningCLI node (``class_path`` + ``init_args``)."""
        if self.stage == 0:
            return {"class_path": "lightning.pytorch.strategies.DDPStrategy"}
        args: dict = {"stage": self.stage}
        if self.offload_optimizer:
            args["offload_optimizer"] = True
        if self.offload_params:
            args["offload_params"] = True
        for key in ("shard_size", "secondary_shard_size"):
            if getattr(self, key) is not None:
                args[key] = getattr(self, key)
        if self.offload_step_delay:
            args["offload_step_delay"] = self.offload_step_delay
        if self.offload_update_interval > 1:
            args["offload_update_interval"] = self.offload_update_interval
        return {"class_path": "lightning_zero.ZeroStrategy", "init_args": args}


#: Every choice, fastest first: less communication first, offloading (host steps and copies) last, as
#: DeepSpeed's and Hugging Face's guides order them (stage 0 > 1 > 2 > 2 + offload > 3 > 3 + offload). On several
#: nodes a hybrid choice goes before its flat stage (2P/k inter-node elements instead of 2P, or 3P at stage 3),
#: hpZ between hybrid and flat stage 3 (2P); they only appear in estimates for more than one node. The delayed update
#: follows the exact offload of its stage: it needs the same device memory and more host memory, so whatever fits it
#: fits the exact step first, and an inexact choice is never the one picked.
_FASTEST_FIRST = (
    "zero1_hsdp",
    "zero1",
    "zero2_hsdp",
    "zero2",
    "zero1_offload",
    "zero2_offload",
    "zero2_offload_delay",
    "zero2_offload_selective",
    "zero3_hsdp",
    "zero3_hpz",
    "zero3",
    "zero3_offload_optimizer",
    "zero3_offload",
)
CHOICES = (
    Choice("ddp", 0),
    *(Choice(name, **REGISTERED_STRATEGIES[name]) for name in _FASTEST_FIRST),
)
#: Each name is also a registered strategy name and a conf/strategy file (``ddp`` is Lightning's).
CHOICES_BY_NAME = {c.name: c for c in CHOICES}


def inter_node_elements(choice: Choice, devices_per_node: int, nodes: int) -> float:
    """Elements each rank sends across nodes per optimizer step, in units of ``P`` (``comm_stats.py``'s counting:
    an all-reduce counts twice its tensor): what a hybrid choice saves over its flat stage."""
    if nodes <= 1:
        return 0.0
    if choice.shard_size == "node":
        return 2 / devices_per_node  # the all-reduce of each rank's P/k gradient shard
    return 3.0 if choice.stage == 3 and choice.secondary_shard_size is None else 2.0


@dataclasses.dataclass(frozen=True)
class Estimate:
    choice: Choice
    device_bytes: float
    host_bytes_per_device: float
    devices_per_node: int
    inter_node_elements: float = 0.0
    """Elements per rank per step across nodes, in units of ``P`` (:func:`inter_node_elements`)."""

    @property
    def host_bytes_per_node(self) -> float:
        """Every device's offloaded share lives in its node's RAM."""
        return self.host_bytes_per_device * self.devices_per_node

    def fits(self, device_bytes: float, host_bytes_per_node: float | None = None) -> bool:
        return self.device_bytes <= device_bytes and (
            host_bytes_per_node is None or self.host_bytes_per_node <= host_bytes_per_node
        )


def model_state_split(
    choice: Choice,
    params: float,
    world_size: int,
    precision: str = "32-true",
    devices_per_node: int | None = None,
    optimizer_state_dtype: str = "fp32",
) -> tuple[float, float]:
    """(device, host) bytes of model state per rank (``devices_per_node``: the node size of hybrid choices,
    ``world_size`` when not given)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; choose one of {PRECISIONS}.")
    if optimizer_state_dtype not in MOMENT_BYTES:
        raise ValueError(f"optimizer_state_dtype={optimizer_state_dtype!r}; choose one of {tuple(MOMENT_BYTES)}.")
    node = devices_per_node or world_size
    p, n = float(params), node if choice.shard_size == "node" else world_size
    weight = grad = 2 if precision != "32-true" else 4  # what forward and backward compute with
    total = 8 + MOMENT_BYTES[optimizer_state_dtype]  # 16 in fp32: weights or masters 4, gradients 4, moments 8
    if choice.secondary_shard_size == "node":
        return total * p / n + weight * p / node, 0.0
    if choice.stage == 0:
        return 16 * p, 0.0
    if choice.offload_params:
        return 0.0, total * p / n
    if choice.offload_optimizer:
        device = {1: (weight + grad) * p, 2: weight * p + grad * p / n, 3: 8 * p / n}[choice.stage]
        host = total + 4 * choice.offload_step_delay  # fp32 masters, their gradients and Adam's moments
        if choice.offload_update_interval > 1:  # the chosen columns' masters and moments, the two interval sums
            device += (4 + MOMENT_BYTES[optimizer_state_dtype]) * choice.offload_topk_ratio * p / n
            host += 8
        return device, host * p / n
    optimizer = total - weight - grad  # Adam's moments, plus the fp32 masters under mixed precision
    return {
        1: (weight + grad) * p + optimizer * p / n,
        2: weight * p + (grad + optimizer) * p / n,
        3: total * p / n,  # FSDP2 keeps fp32 shards of weights and gradients: 4 + 4 + the moments
    }[choice.stage], 0.0


def estimate(
    params: float,
    devices: int,
    nodes: int = 1,
    precision: str = "32-true",
    choices: Iterable[Choice] = CHOICES,
    optimizer_state_dtype: str = "fp32",
) -> list[Estimate]:
    world = devices * nodes
    chosen = [c for c in choices if nodes > 1 or not c.across_nodes]  # on one node they are the flat choices
    return [
        Estimate(
            c,
            *model_state_split(c, params, world, precision, devices, optimizer_state_dtype),
            devices,
            inter_node_elements(c, devices, nodes),
        )
        for c in chosen
    ]


def fastest_fitting(
    estimates: Iterable[Estimate], device_bytes: float, host_bytes_per_node: float | None = None
) -> Estimate | None:
    """The first (fastest) choice whose model states fit the device, and the node's RAM when a limit is given."""
    return next((item for item in estimates if item.fits(device_bytes, host_bytes_per_node)), None)


#: Devices on one node when the user does not say: the common GPU server (DGX/HGX) and DeepSpeed's estimator default.
DEVICES_PER_NODE = 8


def split_devices(devices: int, devices_per_node: int | None = None) -> tuple[int, int]:
    """``(devices per node, nodes)`` of ``devices`` ranks in all, the same for ``estimate`` and ``plan``.

    ``devices`` always counts every rank. Without ``devices_per_node``, up to :data:`DEVICES_PER_NODE` ranks are
    one node and more are nodes of that many; the host memory of a node holds its devices' offloaded state."""
    if devices < 1:
        raise ValueError(f"--devices {devices}: give the number of ranks in all, >= 1.")
    if devices_per_node is None:
        devices_per_node = min(devices, DEVICES_PER_NODE)
        if devices % devices_per_node:
            raise ValueError(
                f"--devices {devices} is not a whole number of {DEVICES_PER_NODE}-device nodes: give "
                "--devices-per-node too (e.g. --devices-per-node 4)."
            )
    if devices_per_node < 1 or devices % devices_per_node:
        raise ValueError(
            f"--devices-per-node {devices_per_node} must be >= 1 and divide --devices {devices} (the ranks in all)."
        )
    return devices_per_node, devices // devices_per_node


def unit_for(*values: float) -> tuple[str, float]:
    """One binary unit for everything printed together (a table, a sentence): GiB once the largest value reaches
    1 GiB, else MiB. ``estimate`` and ``plan`` print every size of one output in it, so no line mixes units."""
    return ("GiB", GIB) if max(values, default=0.0) >= GIB else ("MiB", MIB)


def format_bytes(value: float, unit: tuple[str, float] | None = None) -> str:
    """``value`` bytes in ``unit`` (from :func:`unit_for`; its own by default), two decimals: ``12.50 GiB``."""
    name, scale = unit or unit_for(value)
    return f"{value / scale:.2f} {name}"
