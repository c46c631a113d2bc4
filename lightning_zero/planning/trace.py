"""One training step of the user's LightningModule, traced under ``FakeTensorMode``: what it needs beyond its
parameters, op by op, without allocating any of it.

The module is built inside the fake mode (its ``__init__`` and ``configure_model``: nothing real is allocated,
a billion-parameter model traces in seconds), activation checkpointing is applied as the strategy would apply
it, parameters are cast as a mixed-precision run holds them for compute, and ``training_step`` then backward
run on a fake copy of a real batch under the same autocast as the precision plugin. Torch's ``MemTracker``
(the dispatch mode of ``torch.distributed._tools``) follows every storage; after each operation this tracer
records the bytes alive beyond the parameters, and the bytes of gradients accumulated so far, which
``predict.py`` then re-reads for each stage (a stage keeps, frees or shards gradients differently). Under mixed
precision a model with frozen floating parameters is traced twice: stages 1-2 hold those as built (autocast copies
them at each use), stage 3 gathers them in the compute dtype.

The module is built under ``FakeCopyMode`` as well: a constructor that deep-copies a tensor (torchmetrics copies
every state's default, ``nn.TransformerEncoder`` its layer) would otherwise copy the whole fake mode with it, whose
storage weak references then each get released twice, and the heap is corrupted a few traces later.

With ``sequence_parallel_size=k`` the step is rank 0's of a group of ``k``: the batch is cut as the strategy cuts it
(before it is faked: the cut reads values), a Hugging Face causal LM is wired as the strategy wires it, and attention
runs through a group-less exchange that keeps the real one's shapes and allocations (``sequence_parallel/exchange.py``).

[Note: the causal mask under fake tensors]
A Hugging Face model with sdpa attention builds no mask in a run whose batch has no padding and no packed positions:
sdpa's ``is_causal`` does the masking. Under fake tensors ``transformers`` cannot read the values that tell it so and
builds the ``[B, 1, T, T]`` boolean mask, which put the planner over by a margin growing with ``T^2`` (+64% at 8192
positions with tiles, where the logits no longer hide it). So where the real batch has neither (read before it is
faked), the trace gives each such model's config ``"lightning_zero_traced_sdpa"``: the library's sdpa attention with a
mask function that builds nothing, as the run's skip. A sliding window, padding or packing keep the library's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_zero.activation_checkpointing import (
    activation_offload,
    apply_activation_checkpointing,
    caches_off_for_training,
    resolve_policy,
)
from lightning_zero.engine.mixed_precision import PrecisionPolicy, cast_parameters
from lightning_zero.engine.stage3.fsdp2_units import sharded_by_fsdp2
from lightning_zero.planning.measure import _TotalsOnly
from lightning_zero.sequence_parallel import SequenceParallel
from lightning_zero.sequence_parallel.attention import AttentionInterception, hf_no_mask
from lightning_zero.sequence_parallel.batch import masked_rows
from lightning_zero.sequence_parallel.causal_lm import SequenceParallelWiring, other_than_causal_attention
from lightning_zero.sequence_parallel.parallel import activate
from lightning_zero.tiled_compute import apply_tiled_compute
from lightning_zero.torch_versions.tracing import FakeCopyMode, FakeTensorMode, tree_map_only

#: See [Note: the causal mask under fake tensors].
TRACED_SDPA = "lightning_zero_traced_sdpa"
#: The compute dtype of each Lightning precision the planner knows.
COMPUTE_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """The bytes one training step needs on one rank, beyond the parameters (at the traced micro-batch)."""

    params: int
    """Trainable parameter elements."""
    param_bytes: int
    """Bytes of the parameters as forward computes with them (the compute dtype under mixed precision)."""
    timeline: tuple[tuple[int, int], ...]
    """After each operation of forward and backward: (bytes alive beyond parameters and gradients, bytes of the
    gradients accumulated so far)."""
    unit_elements: tuple[int, ...]
    """Elements stage 3 shards of each stage-3 layer (each block of an ``nn.ModuleList``), in module order: the
    trainable ones and the frozen floating ones, which FSDP2 shards and gathers alike."""
    state_per_element: float
    """Optimizer-state elements per trainable element (Adam 2, SGD with momentum 1), from one traced step of the
    module's own ``configure_optimizers``."""
    batch_size: int
    precision: str
    checkpointing: bool
    offloaded: bool = False
    """The checkpointed inputs were offloaded (``offload_activations``): the traced device bytes leave them out."""
    tiled: bool = False
    """The step ran with ``tiled_compute`` (its tiles' intermediates, not the whole ones, are in the timeline)."""
    sequence_parallel_size: int = 1
    """The step held ``1 / sequence_parallel_size`` of each sequence (``batch_size`` counts whole sequences)."""
    offloaded_host_bytes: int = 0
    """The most bytes of checkpointed inputs the step held in host memory at once (``offload_activations``)."""
    frozen_sharded: int = 0
    """Frozen parameter elements stage 3 shards (a fine-tuned model's base under low-rank adapters): held without
    gradient or optimizer state."""
    frozen_bytes: int = 0
    """Bytes of the frozen parameters, as held."""
    whole_bytes: int = 0
    """Bytes of the parameters stage 3 keeps whole on every rank (integer and 0-dim ones: ``sharded_by_fsdp2``)."""
    stage3_timeline: tuple[tuple[int, int], ...] | None = None
    """:attr:`timeline` again with the frozen floating parameters in the compute dtype too, as stage 3's units
    gather them under mixed precision (stages 1-2 keep them as built, and autocast copies them at each use); None
    where nothing differs (fp32, or no frozen floating parameter)."""

    def timeline_at(self, stage: int) -> tuple[tuple[int, int], ...]:
        """The timeline of ``stage`` (0: Lightning ``ddp``)."""
        return self.stage3_timeline if stage == 3 and self.stage3_timeline is not None else self.timeline

    @property
    def activation_peak(self) -> int:
        """The most bytes alive beyond parameters and gradients at any point of the step."""
        return max(other for other, _ in self.timeline)


class _Timeline(_TotalsOnly):
    """``MemTracker`` totals after every operation; gradients counted by the parameters' accumulate hooks."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.points: list[tuple[int, int]] = []
        self.grad_bytes = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._grad) for p in params if p.requires_grad]
        self._param_bytes = sum(p.numel() * p.element_size() for p in params)

    def _grad(self, param: torch.Tensor) -> None:
        self.grad_bytes += param.numel() * param.element_size()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        total = sum(snap["Total"] for snap in self._curr_mem_snap.values())
        self.points.append((total - self._param_bytes - self.grad_bytes, self.grad_bytes))
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _loss(output: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output


def trace_step(
    build: Callable[[], L.LightningModule],
    batch: Any,
    *,
    precision: str = "32-true",
    activation_checkpointing: Any = None,
    offload_activations: bool = False,
    tiled_compute: bool | int = False,
    sequence_parallel_size: int = 1,
    state_per_element: float | None = None,
) -> StepTrace:
    """Trace ``training_step`` + backward of ``build()`` on ``batch`` (real tensors, only their shapes and dtypes are
    used); ``activation_checkpointing``, ``offload_activations``, ``tiled_compute`` and ``sequence_parallel_size`` as
    ``ZeroStrategy`` takes them.
    Offloaded inputs go to the host outside the tracker, as on a run without an accelerator ([Note: offloaded
    checkpoint inputs]): the timeline is what stays on the device. ``state_per_element``: the optimizer's, from an
    earlier trace of the same module (its step under fake tensors costs as much as a third of a trace)."""
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision={precision!r} cannot be planned; choose one of {sorted(COMPUTE_DTYPES)}.")
    compute = COMPUTE_DTYPES[precision]
    policy = resolve_policy(activation_checkpointing, offload_activations)
    run_skips_mask = masked_rows(batch) is None
    sequence = SequenceParallel(sequence_parallel_size, 0, sequence_parallel_size, None)
    if sequence_parallel_size > 1:
        batch = sequence.split(batch)
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
        warnings.simplefilter("ignore")
        with FakeCopyMode(fake):
            module = build()
            if callable(getattr(module, "configure_model", None)):
                module.configure_model()
        if tiled_compute is not False:
            apply_tiled_compute(module, None if tiled_compute is True else int(tiled_compute))
        if policy is not None:
            # as the strategy trains: a Hugging Face model's cache off (it would hold every layer's keys and values)
            caches_off_for_training(module, apply_activation_checkpointing(module, policy), announce=False)
        trainable = [p for p in module.parameters() if p.requires_grad]
        frozen = [p for p in module.parameters() if not p.requires_grad]
        policy_of_run = PrecisionPolicy(compute_dtype=compute, reduce_dtype=compute) if compute is not None else None
        if policy_of_run is not None:
            cast_parameters(module, trainable, policy_of_run)
        param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)  # as built: stage 3's cast below is its own
        fake_batch = tree_map_only(torch.Tensor, fake.from_tensor, batch)
        module.train()
        wiring = None
        if sequence_parallel_size > 1:
            sequence.shard = sequence.shard.mapped(fake.from_tensor) if sequence.shard is not None else None
            wiring = SequenceParallelWiring(module, sequence_parallel_size)
            activate(sequence)
        masks_restored = _nothing
        try:
            if run_skips_mask:
                masks_restored = _without_the_skipped_mask(module)
            timeline = _traced_step(module, fake_batch, compute, sequence)
            stage3_timeline = None
            if policy_of_run is not None:
                before = [p.dtype for p in frozen]
                cast_parameters(module, [p for p in frozen if sharded_by_fsdp2(p)], policy_of_run)
                if [p.dtype for p in frozen] != before:
                    for p in trainable:
                        p.grad = None
                    stage3_timeline = _traced_step(module, fake_batch, compute, sequence)
        finally:
            masks_restored()
            if wiring is not None:
                wiring.undo()
                activate(None)
        offload = activation_offload(module)
        units = _unit_elements(module)
        trainable_elements = max(1, sum(p.numel() for p in trainable))
        if state_per_element is None:
            state_per_element = _state_elements(module) / trainable_elements
    return StepTrace(
        params=sum(p.numel() for p in trainable),
        param_bytes=param_bytes,
        timeline=timeline,
        unit_elements=tuple(units),
        state_per_element=state_per_element,
        batch_size=_batch_size(batch),
        precision=precision,
        checkpointing=policy is not None,
        offloaded=policy is not None and policy.offload,
        tiled=tiled_compute is not False,
        sequence_parallel_size=sequence_parallel_size,
        offloaded_host_bytes=offload.statistics.peak_host_bytes if offload is not None else 0,
        frozen_sharded=sum(p.numel() for p in frozen if sharded_by_fsdp2(p)),
        frozen_bytes=frozen_bytes,
        whole_bytes=sum(p.numel() * p.element_size() for p in module.parameters() if not sharded_by_fsdp2(p)),
        stage3_timeline=stage3_timeline,
    )


def on_the_line(high: StepTrace, low: StepTrace, micro_batch: int) -> StepTrace | None:
    """The step at ``micro_batch`` from the steps traced at two others, or None where their operations differ in
    number (the module's code depends on the batch size).

    [Note: micro-batches on a line]
    The same code at another batch size runs the same operations, each on tensors whose batch dimension scales: so
    every point of the timeline (bytes alive after each operation) is a line in the micro-batch, through the two
    traced points, and the parameters, their gradients, the optimizer state and the layers are the same. One trace
    per micro-batch the planner weighs costs a second or more for a billion-parameter model; two per checkpointing
    choice (the whole batch and 1) give them all. The micro-batches weighed lie between the two, never beyond: a
    term that grows faster than the batch (an in-batch similarity matrix, ``B x B``) lies under the chord between
    two points, so there the line over-predicts rather than under (beyond them it would under-predict).
    ``tests/unit/test_auto.py`` compares lines with traces."""
    if len(high.timeline) != len(low.timeline) or high.batch_size == low.batch_size:
        return None

    def at(a: int, b: int) -> int:
        return round(b + (a - b) * (micro_batch - low.batch_size) / (high.batch_size - low.batch_size))

    def line(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        return tuple((at(x[0], y[0]), x[1]) for x, y in zip(a, b))

    stage3 = None
    if high.stage3_timeline is not None and low.stage3_timeline is not None:
        stage3 = line(high.stage3_timeline, low.stage3_timeline)
    return dataclasses.replace(
        high,
        timeline=line(high.timeline, low.timeline),
        stage3_timeline=stage3,
        batch_size=micro_batch,
        offloaded_host_bytes=max(0, at(high.offloaded_host_bytes, low.offloaded_host_bytes)),
    )


def _nothing() -> None:
    return None


def _without_the_skipped_mask(module: nn.Module) -> Callable[[], None]:
    """Each Hugging Face model with sdpa attention, causal over whole rows in every layer, traced as
    :data:`TRACED_SDPA`; returns what restores them (see [Note: the causal mask under fake tensors]). A composite
    config (sub-configs: a vision-language model's) keeps its own: its masks may hold more than causality."""
    configs: dict[int, Any] = {}
    for sub in module.modules():
        config: Any = getattr(sub, "config", None)
        if not type(config).__module__.startswith("transformers.") or id(config) in configs:
            continue
        plain = not getattr(config, "sub_configs", None) and other_than_causal_attention(config) is None
        if plain and getattr(sub, "_supports_attention_backend", False) and config._attn_implementation == "sdpa":
            configs[id(config)] = config
    if not configs:
        return _nothing
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TRACED_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(TRACED_SDPA, hf_no_mask)
    for config in configs.values():
        config._attn_implementation = TRACED_SDPA

    def restore() -> None:
        for config in configs.values():
            config._attn_implementation = "sdpa"

    return restore


def _traced_step(
    module: L.LightningModule, batch: Any, compute: torch.dtype | None, sequence: SequenceParallel
) -> tuple[tuple[int, int], ...]:
    """The timeline of one ``training_step`` and backward of ``module`` as it holds its parameters now."""
    tracker = _Timeline(list(module.parameters()))
    tracker.track_external(module)
    across = AttentionInterception(sequence) if sequence.size > 1 else contextlib.nullcontext()
    try:
        with tracker:
            with (
                torch.autocast(
                    "cpu", dtype=compute or torch.bfloat16, enabled=compute is not None, cache_enabled=False
                ),
                across,
            ):  # as the precision plugin and the strategy run forward
                loss = _loss(module.training_step(batch, 0))
            loss.backward()
    finally:
        tracker.close()
    return tuple(tracker.points)


def _state_elements(module: L.LightningModule) -> int:
    """Optimizer-state elements after one step of the module's own optimizers (fake tensors: nothing runs)."""
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    optimizers = configured if isinstance(configured, (list, tuple)) else [configured]
    total = 0
    for optimizer in optimizers:
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        with torch.no_grad():
            optimizer.step()
        total += sum(
            v.numel()
            for entry in optimizer.state.values()
            for v in entry.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
    return total


def _unit_elements(module: nn.Module) -> list[int]:
    """Elements stage 3 shards of each element of every ``nn.ModuleList`` (stage 3's default units)."""
    units: list[int] = []
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList):
            units.extend(sum(p.numel() for p in block.parameters() if sharded_by_fsdp2(p)) for block in sub)
    return units


def _batch_size(batch: Any) -> int:
    sizes = []
    tree_map_only(torch.Tensor, lambda t: sizes.append(t.shape[0] if t.dim() else 1), batch)
    return sizes[0] if sizes else 1
