"""The planner's pick written where a run reads it: a config group file for ``lightning-zero fit`` (strategy,
accumulation and micro-batch), a ``conf/strategy``-style YAML, or a DeepSpeed-style JSON that
``ZeroStrategy(config=...)`` reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from lightning_zero.planning.plan import Candidate


def strategy_node(pick: Candidate, checkpointing: Any) -> dict:
    """``trainer.strategy`` as LightningCLI reads it."""
    args = pick.configuration.strategy_args()
    if pick.checkpointing and checkpointing is not None:
        args["activation_checkpointing"] = _class_path(checkpointing)
        if pick.offloaded:
            args["offload_activations"] = True
    if pick.tiled_compute is not False:
        args["tiled_compute"] = pick.tiled_compute
    if pick.sequence_parallel_size > 1:
        args["sequence_parallel_size"] = pick.sequence_parallel_size
    return {"class_path": "lightning_zero.ZeroStrategy", "init_args": args}


def write_group_file(
    path: Path, pick: Candidate, checkpointing: Any, summary: str, data_keys: tuple[str, ...] = ()
) -> None:
    """A ``# @package _global_`` group file: ``strategy=<stem>`` sets the strategy, the accumulation and (where the
    config names it) the per-device batch size together."""
    body: dict = {
        "trainer": {"strategy": strategy_node(pick, checkpointing), "accumulate_grad_batches": pick.accumulate}
    }
    if data_keys:
        node = body
        for key in data_keys[:-1]:
            node = node.setdefault(key, {})
        node[data_keys[-1]] = pick.micro_batch
    path.parent.mkdir(parents=True, exist_ok=True)
    comments = "".join(f"# {line}\n" for line in summary.splitlines())
    path.write_text(f"# @package _global_\n{comments}{yaml.safe_dump(body, sort_keys=False)}")


def deepspeed_config(pick: Candidate, checkpointing: Any, world_size: int, precision: str) -> dict:
    """A DeepSpeed-style config of the pick (the keys ``deepspeed_compat/config.py`` maps)."""
    c = pick.configuration
    zero: dict = {"stage": c.stage}
    if c.offload_optimizer:
        zero["offload_optimizer"] = {
            "device": "cpu",
            **({"ratio": c.offload_optimizer} if c.offload_optimizer < 1 else {}),
        }
    if c.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    out: dict = {
        "train_batch_size": pick.micro_batch * pick.accumulate * world_size // pick.sequence_parallel_size,
        "train_micro_batch_size_per_gpu": pick.micro_batch,
        "gradient_accumulation_steps": pick.accumulate,
        "zero_optimization": zero,
    }
    if precision.startswith("bf16"):
        out["bf16"] = {"enabled": True}
    elif precision.startswith("16"):
        out["fp16"] = {"enabled": True}
    if pick.sequence_parallel_size > 1:
        out["sequence_parallel_size"] = pick.sequence_parallel_size
    if pick.checkpointing and checkpointing is not None:
        out["activation_checkpointing"] = {"classes": [_class_path(checkpointing)]}
        if pick.offloaded:
            out["activation_checkpointing"]["cpu_checkpointing"] = True
    return out


def write_generated(
    path: Path, pick: Candidate, checkpointing: Any, world_size: int, precision: str, summary: str
) -> None:
    """``.json``: the DeepSpeed-style config; ``.yaml``/``.yml``: the same as a group file."""
    if path.suffix == ".json":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(deepspeed_config(pick, checkpointing, world_size, precision), indent=2) + "\n")
    elif path.suffix in (".yaml", ".yml"):
        write_group_file(path, pick, checkpointing, summary)
    else:
        raise ValueError(f"--output {path}: write a .json (DeepSpeed-style) or a .yaml/.yml (config group) file.")


def _class_path(policy: Any) -> Any:
    return f"{policy.__module__}.{policy.__qualname__}" if isinstance(policy, type) else policy
