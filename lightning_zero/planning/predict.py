"""Peak bytes per device and per host of one configuration, from a traced step (``trace.py``).

[Note: the memory model]
A rank's memory has a *static* part, alive across steps (the ZeRO formulas' model state, with the optimizer's
own state size per element as traced, 2 bytes each under ``optimizer_state_dtype="bf16"``), and a *dynamic* part that rises and falls within a step. The trace gives,
after every operation of forward and backward, the bytes alive beyond parameters and gradients (activations,
the batch, logits, temporaries, recomputation under activation checkpointing) and the gradient bytes produced so
far. Each stage keeps those gradients differently, so the dynamic part is the most, over the traced operations,
of the activations then alive plus the gradients the stage holds then:

* stage 1: every full gradient produced so far (``p.grad`` is kept whole);
* stage 2: at most one bucket's worth (gradients are packed into a bucket and freed as it fills), on top of the
  persistent gradient shard;
* stage 3: in forward, the unit computing is gathered (adjacent layers merged up to ``unit_size_mb``); in backward
  also the unit prefetched, with one unit's full gradients and the shards of the units reduced before it (the
  root's parameters, outside every unit, stay gathered throughout).

With gradient accumulation, the micro-batches before the last keep every gradient whole and unreduced (``p.grad``
at stages 1-2, FSDP2's unsharded gradients at stage 3), so those are held throughout the next micro-batch; stage 3
also keeps every unit gathered from the window's first forward to its last backward (without ``offload_params``:
[Note: gathered accumulation windows] in ``engine/stage3/fsdp2_window.py``).

The optimizer step is the other candidate for the peak: the static part, the gradients the step reads and, at
stages 1-2, the full-size buffers of the post-step all-gather (two buckets in flight; none over gloo, where the
rows are gathered straight into the parameters: [Note: collectives in place] in ``engine/comm/p2p_transport.py``),
and bf16 state's fp32 tile widened for the step where the state is on the device (``engine/state_dtype.py``).
The peak is the larger.
Host memory holds what offload puts there: ``r`` of the masters, their gradients and the optimizer state
(``offload_optimizer=r``), and at stage 3 with ``offload_params`` the parameter and gradient shards too; with every
master offloaded and clipping by the global norm, the copies of the masters and state that the parts stepped during
backward keep until the clip is known ([Note: speculative clipping] in ``engine/offload/speculation.py``). Selective
updates keep their chosen columns' fp32 masters and state on the device and two interval sums of the gradients on the
host ([Note: selective updates] in ``engine/offload/selective.py``).
"""

from __future__ import annotations

import dataclasses

from lightning_zero.config.zero_config import DEFAULT_TOPK_RATIO
from lightning_zero.engine.stage3.fsdp2_units import merged_lengths
from lightning_zero.engine.state_dtype import STATE_DTYPES, TILE_ELEMENTS
from lightning_zero.planning.trace import StepTrace

#: Buckets of the stage 1-2 post-step all-gather alive at once (``grad_sync.MAX_BUCKETS_IN_FLIGHT``).
GATHER_BUCKETS_IN_FLIGHT = 2
KINDS = ("parameters", "gradients", "optimizer state", "activations", "buffers")


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One way to run the traced step: a stage (0: Lightning ``ddp``) and what is offloaded."""

    stage: int
    offload_optimizer: float = 0.0
    """Share of the optimizer's masters and state in host memory (``True`` is 1.0)."""
    offload_params: bool = False
    bucket_size_mb: float = 25.0
    unit_size_mb: float = 100.0
    """Stage 3: adjacent layers share one gathered unit up to this size (``ZeroStrategy(unit_size_mb=...)``)."""
    optimizer_state_dtype: str = "fp32"
    """``"bf16"``: the optimizer's per-element state held in 2 bytes (``engine/state_dtype.py``)."""
    offload_update_interval: int = 1
    """``k > 1``: selective updates (``engine/offload/selective.py``), with ``offload_topk_ratio`` of the columns on
    the device."""
    offload_topk_ratio: float = DEFAULT_TOPK_RATIO

    @property
    def name(self) -> str:
        if self.stage == 0:
            return "ddp"
        name = f"zero{self.stage}"
        if self.offload_params:
            return name + "_offload"
        if self.offload_optimizer >= 1 and self.selective:
            return name + f"_offload_selective{self.offload_update_interval}"
        if self.offload_optimizer >= 1:
            return name + ("_offload_optimizer" if self.stage == 3 else "_offload")
        if self.offload_optimizer > 0:
            return name + f"_offload{self.offload_optimizer:g}"
        return name

    @property
    def selective(self) -> bool:
        return self.offload_update_interval > 1

    def strategy_args(self) -> dict:
        args: dict = {"stage": self.stage}
        if self.offload_optimizer:
            args["offload_optimizer"] = True if self.offload_optimizer >= 1 else float(self.offload_optimizer)
        if self.offload_params:
            args["offload_params"] = True
        if self.bucket_size_mb != 25.0:
            args["bucket_size_mb"] = self.bucket_size_mb
        if self.unit_size_mb != 100.0 and self.stage == 3:
            args["unit_size_mb"] = self.unit_size_mb
        if self.optimizer_state_dtype != "fp32":
            args["optimizer_state_dtype"] = self.optimizer_state_dtype
        if self.selective:
            args["offload_update_interval"] = self.offload_update_interval
            if self.offload_topk_ratio != DEFAULT_TOPK_RATIO:
                args["offload_topk_ratio"] = self.offload_topk_ratio
        return args


@dataclasses.dataclass(frozen=True)
class Prediction:
    configuration: Configuration
    trace: StepTrace
    device_bytes: int
    """Peak bytes per device."""
    host_bytes: int
    """Bytes per rank in host memory (offloaded state, and checkpointed inputs with ``offload_activations``)."""
    breakdown: dict[str, int]
    """The device peak by kind (:data:`KINDS`)."""


def predict(
    trace: StepTrace,
    configuration: Configuration,
    world_size: int,
    accumulate: int = 1,
    *,
    backend: str = "nccl",
    clipped: bool = False,
) -> Prediction:
    """Peak device and host bytes of one rank running ``trace`` under ``configuration`` on ``world_size`` ranks,
    ``accumulate`` micro-batches per optimizer step (the non-final ones keep whole gradients, unreduced), over the
    process-group ``backend`` the run will use; ``clipped``: the run clips by the global norm, so an offloaded step
    that starts during backward keeps copies of what it writes ([Note: speculative clipping])."""
    c, n, p = configuration, world_size, trace.params
    mixed = trace.precision != "32-true"
    grad_size = 2 if mixed else 4  # gradients are held in the parameters' dtype
    weights = trace.param_bytes  # as forward computes with them
    state_dtype = STATE_DTYPES[c.optimizer_state_dtype] if c.stage != 0 else None  # ddp: the optimizer's own
    state = (state_dtype.itemsize if state_dtype is not None else 4) * trace.state_per_element * p  # whole model
    # bf16 state is widened to fp32 a tile at a time for the step, where it is on the device.
    widened = 0 if state_dtype is None else 4 * trace.state_per_element * min(TILE_ELEMENTS, p / n)
    masters = 4 * p if mixed else 0
    r = 1.0 if c.offload_params else c.offload_optimizer
    bucket = int(c.bucket_size_mb * 2**20) // 4  # elements of one gradient bucket
    points = trace.timeline_at(c.stage)

    if c.stage == 0:  # Lightning ddp: fp32 parameters, full gradients (in its buckets), full optimizer state
        static = {"parameters": 4 * p + trace.frozen_bytes, "optimizer state": state}
        dynamic = _most(points, lambda grads: grads * 4 / grad_size)
        grads_at_step: float = 4 * p
        host = 0.0
        gathered = 0
        step_buffers: float = 0
    elif c.stage in (1, 2):
        static = {"parameters": weights, "optimizer state": (1 - r) * (state + masters) / n}
        host = r * (state + (masters or 4 * p) + 4 * p) / n  # state, master copies and their gradient buffers
        if c.selective:  # the chosen columns' fp32 masters and state on the device; the host's two interval sums
            static["optimizer state"] += c.offload_topk_ratio * (4 * p + state) / n
            host += 8 * p / n
        if c.stage == 2:
            static["gradients"] = grad_size * p / n  # the reduced shard, kept across steps
            held = grad_size * p if accumulate > 1 else grad_size * bucket
            dynamic = _most(points, lambda grads: min(grads, held) if accumulate == 1 else held)
            grads_at_step = grad_size * p / n + (1 - r) * (4 * p / n if mixed else 0)
        else:
            dynamic = _most(points, lambda grads: grads if accumulate == 1 else grad_size * p)
            grads_at_step = grad_size * p + (1 - r) * (4 * p / n if mixed else 0)
        gathered = 0
        step_buffers = 0 if backend == "gloo" else GATHER_BUCKETS_IN_FLIGHT * min(bucket, p) * (weights / max(p, 1))
    else:
        compute_size = 2 if mixed else 4
        sharded = p + trace.frozen_sharded  # frozen floating parameters are sharded and gathered too
        units = _merged_units(trace.unit_elements, c.unit_size_mb * 2**20 / compute_size) or [sharded]
        unit = max(units)
        # Backward holds a unit and the one before it, prefetched (one unit alone when everything merged into one).
        pair = max((a + b for a, b in zip(units, units[1:])), default=unit)
        root = max(0, sharded - sum(trace.unit_elements))
        shards = 4 * sharded / n  # FSDP2's fp32 parameter shards
        on_host = 1.0 if c.offload_params else 0.0
        # integer and 0-dim parameters stay whole, on the device
        static = {"parameters": (1 - on_host) * shards + trace.whole_bytes, "optimizer state": (1 - r) * state / n}
        # offload_params: parameter and gradient shards and the state; offload_optimizer alone: the state, host
        # copies of the shards and their gradient buffers (16P/N either way, of the share offloaded).
        host = on_host * (shards + 4 * p / n) + r * state / n + (r * 8 * p / n if not c.offload_params else 0)
        # Forward holds the root and the unit computing, twice over while FSDP2 copies its all-gather output into the
        # parameters; backward also the unit prefetched and the unit's gradients before their reduce-scatter (no
        # gradient yet: still forward).
        gathered = compute_size * root
        accumulated = grad_size * p if accumulate > 1 else 0  # FSDP2 keeps unsharded gradients between micro-batches
        if accumulate > 1 and not c.offload_params:  # every unit stays gathered through the window
            gathered = compute_size * sharded
            dynamic = _most(points, lambda grads: accumulated)
        else:
            # A unit's gradient shards exist once its full gradients are reduced and freed: the shards held beside
            # a unit's full gradients are those of the gradients produced before it.
            dynamic = _most(
                points,
                lambda grads: (
                    accumulated
                    + (
                        2 * compute_size * unit
                        if grads == 0
                        else compute_size * pair
                        + min(grads, grad_size * unit)
                        + (1 - on_host) * max(0, grads - grad_size * unit) * 4 / grad_size / n
                    )
                ),
            )
        grads_at_step = (1 - on_host) * 4 * p / n
        step_buffers = 0
    static_total = sum(static.values())
    if r < 1 and c.stage != 0:
        step_buffers += widened
    activations, held_grads = dynamic
    during = static_total + gathered + activations + held_grads
    at_step = static_total + grads_at_step + step_buffers
    breakdown = dict(static)
    if during >= at_step:
        breakdown.update(activations=activations, buffers=gathered)
        breakdown["gradients"] = breakdown.get("gradients", 0) + held_grads
    else:
        breakdown["buffers"] = step_buffers
        breakdown["gradients"] = breakdown.get("gradients", 0) + grads_at_step
    by_kind = {kind: int(breakdown.get(kind, 0)) for kind in KINDS}
    if clipped and c.offload_optimizer >= 1 and not c.offload_params and c.stage != 0 and not c.selective:
        host += (4 * p + state) / n  # the speculated parts' copies of their masters and state
    host += trace.offloaded_host_bytes  # the most checkpointed inputs one micro-batch holds on the host at once
    return Prediction(c, trace, int(max(during, at_step)), int(host), by_kind)


def _merged_units(layers: tuple[int, ...], budget: float) -> list[int]:
    """Elements of each stage-3 unit, in order, once adjacent layers merge within ``budget`` elements
    (``fsdp2_units``'s rule, every ``ModuleList``'s blocks taken as one run)."""
    units, start = [], 0
    for length in merged_lengths(list(layers), budget):
        units.append(sum(layers[start : start + length]))
        start += length
    return units


def _most(points, held) -> tuple[float, float]:
    """(activations, gradients held) at the traced operation where their sum is largest; ``held(grads)`` is what
    the stage holds of the gradients produced so far."""
    return max(((other, held(grads)) for other, grads in points), key=sum)
