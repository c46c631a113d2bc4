"""What the planner plans for: a training config (the model, one real batch of its data, the Trainer's devices,
precision and accumulation), or a size alone (a standard decoder-only transformer of that many parameters)."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_zero.planning.formulas import GIB, split_devices

#: GPT-3's shapes (Brown et al., 2020, table 2.1): (parameters, layers, width, heads). ``--params`` plans for the
#: row closest in size; vocabulary 50257, biases and untied embeddings as ``lightning_zero.demo.GPTLightningModule``.
GPT3_SHAPES = (
    (125e6, 12, 768, 12), (350e6, 24, 1024, 16), (760e6, 24, 1536, 16), (1.3e9, 24, 2048, 16), (2.7e9, 32, 2560, 32),
    (6.7e9, 32, 4096, 32), (13e9, 40, 5120, 40), (175e9, 96, 12288, 96),
)
VOCAB = 50257
#: The device memory a plan assumes on a machine without an accelerator: the common large training GPU (A100 and
#: H100 80 GiB models). Said in the plan's output, since it is a guess.
COMMON_DEVICE_MEMORY = 80 * GIB


def device_memory() -> tuple[float, str]:
    """The memory per device to plan for when the user gives none, and where it comes from (for the output): this
    machine's accelerator (torch.cuda, device 0) when there is one, else :data:`COMMON_DEVICE_MEMORY`."""
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        return float(properties.total_memory), f"this machine's {properties.name} (cuda:0)"
    return float(COMMON_DEVICE_MEMORY), ("assumed: no accelerator on this machine, so a common 80 GiB device such as "
                                         "an A100 or H100")


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


def from_config(config: dict[str, Any], devices: int | None = None, name: str = "the config",
                devices_per_node: int | None = None) -> Source:
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
        build=lambda: model_cls(**kwargs), batch=batch, world_size=world, devices_per_host=per_node,
        precision=str(trainer.get("precision") or "32-true"), accumulate=int(trainer.get("accumulate_grad_batches") or 1),
        checkpointing=init_args.get("activation_checkpointing") or _repeated_block(lambda: model_cls(**kwargs)),
        description=f"{name}: {model['class_path']}",
        data_keys=("data", "init_args", "batch_size") if "batch_size" in (data.get("init_args") or {}) else (),
        backend="gloo" if trainer.get("accelerator") == "cpu" else "nccl",
    )


def _class_node(config: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    node = config.get(key)
    if not isinstance(node, dict) or "class_path" not in node:
        raise ValueError(f"{name} gives no `{key}` with a `class_path`: the planner builds both.")
    return node


def from_size(params: float, devices: int, batch_size: int, seq_len: int = 2048, precision: str = "bf16-mixed",
              devices_per_node: int | None = None) -> Source:
    """A GPT of GPT-3's shape closest to ``params`` parameters, ``batch_size`` sequences per step over ``devices``
    ranks in all (on nodes of ``devices_per_node``, by default ``formulas.split_devices``'s)."""
    from lightning_zero.demo.gpt import Block, GPTLightningModule

    if batch_size % devices:
        raise ValueError(f"--batch-size {batch_size} must be a multiple of --devices {devices} (a global batch split "
                         "evenly over the devices).")
    per_node, _ = split_devices(devices, devices_per_node)
    size, layers, width, heads = min(GPT3_SHAPES, key=lambda row: abs(row[0] - params))
    per_device = batch_size // devices
    tokens = torch.zeros(per_device, seq_len, dtype=torch.long)
    return Source(
        build=lambda: GPTLightningModule(vocab_size=VOCAB, block_size=seq_len, n_layer=layers, n_head=heads,
                                         n_embd=width, dropout=0.0),
        batch=(tokens, tokens), world_size=devices,
        devices_per_host=per_node, precision=precision, checkpointing=Block,
        description=f"a GPT of GPT-3's {size:.3g}-parameter shape ({layers} layers x {width} wide, {heads} heads, "
                    f"vocabulary {VOCAB}, sequence {seq_len})",
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
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub):
            return type(sub[0])
    return None
