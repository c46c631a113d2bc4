"""What the planner plans for: a training config (the model, one real batch of its data, the Trainer's devices,
precision and accumulation), or a size alone (a standard decoder-only transformer of that many parameters)."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_zero.planning.auto import repeated_block
from lightning_zero.planning.formulas import GIB, split_devices

#: GPT-3's shapes (Brown et al., 2020, table 2.1): (parameters, layers, width, heads). ``--params`` plans a GPT
#: scaled to the size asked, as deep as these rows are at that size (:func:`gpt_shape`); vocabulary 50257, biases and
#: untied embeddings as ``lightning_zero.demo.GPTLightningModule``.
GPT3_SHAPES = (
    (125e6, 12, 768, 12),
    (350e6, 24, 1024, 16),
    (760e6, 24, 1536, 16),
    (1.3e9, 24, 2048, 16),
    (2.7e9, 32, 2560, 32),
    (6.7e9, 32, 4096, 32),
    (13e9, 40, 5120, 40),
    (175e9, 96, 12288, 96),
)
VOCAB = 50257
#: The sizes ``--params`` plans for: GPT-3's smallest row up to a trillion parameters (about 6x its largest row, the
#: depth extrapolated along its two largest). At it, the two 50257-token embeddings are already half the model.
MIN_PARAMS, MAX_PARAMS = 125e6, 1e12
#: How close the planned GPT's parameter count comes to ``--params`` at most (relative); a size no shape reaches
#: this close (a sequence so long that its position embeddings outweigh the model) is refused. Within half of it the
#: shape nearest GPT-3's depth is kept, else the nearest within it: widths step by 64 or 128, so the count moves in
#: steps of several percent at a given depth.
SHAPE_TOLERANCE = 0.02
#: The device memory a plan assumes on a machine without an accelerator: the common large training GPU (A100 and
#: H100 80 GiB models). Said in the plan's output, since it is a guess.
COMMON_DEVICE_MEMORY = 80 * GIB


def device_memory() -> tuple[float, str]:
    """The memory per device to plan for when the user gives none, and where it comes from (for the output): this
    machine's accelerator (torch.cuda, device 0) when there is one, else :data:`COMMON_DEVICE_MEMORY`."""
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        return float(properties.total_memory), f"this machine's {properties.name} (cuda:0)"
    return float(COMMON_DEVICE_MEMORY), (
        "assumed: no accelerator on this machine, so a common 80 GiB device such as an A100 or H100"
    )


@dataclasses.dataclass
class Source:
    """A model to build (inside the tracer's fake mode), a sample batch of one device, and the run around it."""

    build: Callable[[], Any]
    batch: Any
    world_size: int
    devices_per_host: int
    precision: str = "32-true"
    accumulate: int = 1
    checkpointing: Any = None
    """The activation-checkpointing policy to weigh (the config's own, else the model's repeated block class)."""
    description: str = ""
    data_keys: tuple[str, ...] = ()
    """Where the config sets the per-device batch size (``data.init_args.batch_size``), if it does."""
    backend: str = "nccl"
    """The process-group backend of the planned run: ``"gloo"`` where the config trains on the CPU."""
    optimizer_state_dtype: str = "fp32"
    """``ZeroStrategy(optimizer_state_dtype=...)`` of the planned run: the config's, else ``plan``'s flag."""
    clipped: bool = False
    """The config clips by the global norm (``trainer.gradient_clip_val``, algorithm ``norm``)."""
    tiled_compute: bool | int = False
    """``ZeroStrategy(tiled_compute=...)`` of the planned run (the config's)."""
    sequence_parallel_size: int = 1
    """``ZeroStrategy(sequence_parallel_size=...)`` of the planned run (the config's, or ``plan``'s flag)."""


def from_config(
    config: dict[str, Any], devices: int | None = None, name: str = "the config", devices_per_node: int | None = None
) -> Source:
    """The model, data and Trainer settings of a composed ``lightning-zero fit`` config (``cli/plan.py`` composes
    it from the files and overrides). ``devices`` counts every rank (as ``estimate``'s does); by default the
    config's ``trainer.devices x trainer.num_nodes``, on nodes of ``trainer.devices``."""
    model, data = _class_node(config, "model", name), _class_node(config, "data", name)
    trainer = config.get("trainer") or {}
    model_cls = _import(model["class_path"])
    datamodule = _import(data["class_path"])(**(data.get("init_args") or {}))
    datamodule.prepare_data()
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    config_per_node = int(trainer.get("devices") or 1)
    world = int(devices or config_per_node * int(trainer.get("num_nodes") or 1))
    if devices_per_node is None and world % config_per_node == 0:
        devices_per_node = config_per_node
    per_node, _ = split_devices(world, devices_per_node)
    strategy = trainer.get("strategy")
    init_args = strategy.get("init_args", {}) if isinstance(strategy, dict) else {}
    kwargs = model.get("init_args") or {}
    return Source(
        build=lambda: model_cls(**kwargs),
        batch=batch,
        world_size=world,
        devices_per_host=per_node,
        precision=str(trainer.get("precision") or "32-true"),
        accumulate=int(trainer.get("accumulate_grad_batches") or 1),
        checkpointing=init_args.get("activation_checkpointing") or _repeated_block(lambda: model_cls(**kwargs)),
        description=f"{name}: {model['class_path']}",
        data_keys=("data", "init_args", "batch_size") if "batch_size" in (data.get("init_args") or {}) else (),
        backend="gloo" if trainer.get("accelerator") == "cpu" else "nccl",
        optimizer_state_dtype=str(init_args.get("optimizer_state_dtype") or "fp32"),
        clipped=bool(trainer.get("gradient_clip_val")) and trainer.get("gradient_clip_algorithm") in (None, "norm"),
        tiled_compute=init_args.get("tiled_compute", False),
        sequence_parallel_size=int(init_args.get("sequence_parallel_size") or 1),
    )


def _class_node(config: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    node = config.get(key)
    if not isinstance(node, dict) or "class_path" not in node:
        raise ValueError(f"{name} gives no `{key}` with a `class_path`: the planner builds both.")
    return node


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """The GPT that ``--params`` plans: its shape and exact parameter count (``demo.count_parameters``), said in
    the plan's header so a user sees the model planned, not only the size asked."""

    layers: int
    width: int
    heads: int
    params: int


def gpt_parameters(layers: int, width: int, seq_len: int, vocab: int = VOCAB) -> int:
    """The parameters of ``GPTLightningModule`` (biases, untied embeddings) in closed form, so the shape search can
    solve for the width; ``demo.count_parameters`` stays the count reported (a unit test pins the two equal).
    Each block: two LayerNorms (4 width) and the attention and MLP linears (12 width^2 + 9 width); around them the
    token, position and output embeddings and the final LayerNorm."""
    per_block = 12 * width * width + 13 * width
    return layers * per_block + (2 * vocab + seq_len + 2) * width


def gpt_shape(params: float, seq_len: int = 2048, vocab: int = VOCAB, heads_multiple: int = 1) -> GPTShape:
    """A GPT of ``params`` parameters (within :data:`SHAPE_TOLERANCE`), so that a plan is for the size asked: as
    deep as GPT-3's rows are at that size (log-linear between them), give or take a quarter, the width solved for
    the rest, a multiple of 64 (heads of 64) below 2048 and of 128 (heads of 128) from there, as most of GPT-3's
    shapes are, with a number of heads that is a multiple of ``heads_multiple`` (a sequence-parallel group splits
    them). A size out of :data:`MIN_PARAMS` .. :data:`MAX_PARAMS` is refused rather than planned as another."""
    from lightning_zero.demo.gpt import GPTConfig, count_parameters

    if not (math.isfinite(params) and MIN_PARAMS <= params <= MAX_PARAMS):
        raise ValueError(
            f"--params {params:.4g} is out of the sizes the planner shapes a GPT for: {MIN_PARAMS:.4g} to "
            f"{MAX_PARAMS:.4g} (GPT-3's smallest shape to a trillion parameters)."
        )
    depth = _gpt3_depth(params)
    candidates = []
    for layers in range(max(1, math.floor(0.75 * depth)), math.ceil(1.25 * depth) + 1):
        quadratic, linear = 12 * layers, 13 * layers + 2 * vocab + seq_len + 2
        exact_width = (math.sqrt(linear * linear + 4 * quadratic * params) - linear) / (2 * quadratic)
        head_width = 128 if exact_width >= 2048 else 64
        groups = exact_width / head_width / heads_multiple
        for heads in {max(1, math.floor(groups)) * heads_multiple, max(1, math.ceil(groups)) * heads_multiple}:
            count = gpt_parameters(layers, heads * head_width, seq_len, vocab)
            candidates.append((abs(count / params - 1), layers, heads * head_width, heads))
    close = [c for c in candidates if c[0] <= SHAPE_TOLERANCE]
    if not close:
        nearest = min(candidates)
        raise ValueError(
            f"--params {params:.4g} with --seq-len {seq_len}: no GPT shape comes within "
            f"{SHAPE_TOLERANCE:.0%} of it (the nearest, {nearest[1]} layers x {nearest[2]} wide, is "
            f"{nearest[0]:.1%} off); a shorter --seq-len or a larger --params would be shaped."
        )
    _, layers, width, heads = min(close, key=lambda c: (c[0] > SHAPE_TOLERANCE / 2, abs(math.log(c[1] / depth)), c[0]))
    config = GPTConfig(vocab_size=vocab, block_size=seq_len, n_layer=layers, n_head=heads, n_embd=width)
    return GPTShape(layers=layers, width=width, heads=heads, params=count_parameters(config))


def _gpt3_depth(params: float) -> float:
    """GPT-3's depth at ``params`` parameters: log-linear in size between the rows of :data:`GPT3_SHAPES` around
    it, and along its two largest rows beyond them."""
    points = [(math.log(size), math.log(layers)) for size, layers, _, _ in GPT3_SHAPES]
    x = math.log(params)
    (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if x <= b[0]), (points[-2], points[-1]))
    return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def from_size(
    params: float,
    devices: int,
    batch_size: int,
    seq_len: int = 2048,
    precision: str = "bf16-mixed",
    devices_per_node: int | None = None,
    sequence_parallel_size: int = 1,
) -> Source:
    """A GPT of ``params`` parameters (:func:`gpt_shape`), ``batch_size`` sequences per step over ``devices`` ranks
    in all (on nodes of ``devices_per_node``, by default ``formulas.split_devices``'s), each sequence shared by
    ``sequence_parallel_size`` of them."""
    from lightning_zero.demo.gpt import Block, GPTLightningModule

    if devices % sequence_parallel_size:
        raise ValueError(
            f"--sequence-parallel-size {sequence_parallel_size} must divide --devices {devices} (each sequence is "
            "shared by that many ranks)."
        )
    replicas = devices // sequence_parallel_size
    if batch_size % replicas:
        over = (
            f"--devices {devices}"
            if sequence_parallel_size == 1
            else (
                f"the {replicas} data-parallel replicas (--devices {devices} / --sequence-parallel-size "
                f"{sequence_parallel_size})"
            )
        )
        raise ValueError(
            f"--batch-size {batch_size} must be a multiple of {over} (a global batch split evenly over them)."
        )
    per_node, _ = split_devices(devices, devices_per_node)
    shape = gpt_shape(params, seq_len, heads_multiple=sequence_parallel_size)
    per_device = batch_size // replicas
    tokens = torch.zeros(per_device, seq_len, dtype=torch.long)
    return Source(
        build=lambda: GPTLightningModule(
            vocab_size=VOCAB,
            block_size=seq_len,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_embd=shape.width,
            dropout=0.0,
        ),
        batch=(tokens, tokens),
        world_size=devices,
        devices_per_host=per_node,
        precision=precision,
        checkpointing=Block,
        sequence_parallel_size=sequence_parallel_size,
        description=f"a GPT of {shape.params:,} parameters for --params {params:.4g} ({shape.layers} layers x "
        f"{shape.width} wide, {shape.heads} heads, vocabulary {VOCAB}, sequence {seq_len})",
    )


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"cannot import {path!r}: {err}") from None


def _repeated_block(build: Callable[[], Any]) -> type[nn.Module] | None:
    """The class of the blocks of the model's first ``nn.ModuleList`` (a transformer's layers), built on meta."""
    with torch.device("meta"):
        module = build()
        if callable(getattr(module, "configure_model", None)):
            module.configure_model()
    return repeated_block(module)
