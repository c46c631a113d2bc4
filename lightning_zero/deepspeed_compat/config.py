"""DeepSpeed-style JSON configs mapped onto ZeroStrategy, Trainer, precision, optimizer and scheduler settings.

A DeepSpeed user already has a ``ds_config.json``; ``ZeroStrategy(config="ds_config.json")`` reads it so they do
not have to translate it by hand. The rules:

- every key is either mapped, or a *tuning* key that has no meaning here (a warning naming it), or refused
  with an error naming it and the supported keys: nothing is silently ignored;
- ``"auto"`` (as in Hugging Face configs) means "take it from the Trainer / LightningModule";
- a setting given both in the JSON and explicitly (a ZeroStrategy argument, a Trainer argument, a
  ``configure_optimizers``) is an error when the two differ, never a silent override.

:func:`parse_deepspeed_config` only reads and checks; :class:`DeepSpeedSettings` holds the result, and the
strategy applies the Trainer-level, precision and optimizer parts when it is attached to a Trainer
(``trainer.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_zero.config.choices import ZeroConfigError, closest
from lightning_zero.config.compression import COMPRESSION_KEYS, QUANTIZED_ZERO_KEYS, deepspeed_compression
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.precision.loss_scaler import LossScaleConfig, LossScaleConfigError

AUTO = "auto"

#: Top-level keys that only tune DeepSpeed's own logging, profiling or kernels.
TUNING_KEYS = frozenset(
    {
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "memory_breakdown",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comms_logger",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "checkpoint",
        "data_types",
        "amp_enabled",
        "timers",
        "elasticity",
    }
)
#: ``zero_optimization`` keys that tune DeepSpeed's buffers and prefetching.
ZERO_TUNING_KEYS = frozenset(
    {
        "allgather_partitions",
        "allgather_bucket_size",
        "reduce_scatter",
        "contiguous_gradients",
        "round_robin_gradients",
        "elastic_checkpoint",
        "load_from_fp32_weights",
        "cpu_offload_use_pin_memory",
        "sub_group_size",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "ignore_unused_parameters",
        "legacy_stage1",
        "memory_efficient_linear",
        "use_multi_rank_bucket_allreduce",
    }
)
#: DeepSpeed's (and Hugging Face's) spellings of "also write consolidated 16-bit weights on save".
GATHER_16BIT_KEYS = (
    "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
)
#: Topology-aware sharding: MiCS groups and ZeRO++ hierarchical partitioning (hpZ).
HYBRID_KEYS = ("mics_shard_size", "mics_hierarchical_params_gather", "zero_hpz_partition_size")
ZERO_KEYS = frozenset(
    {
        "stage",
        "offload_optimizer",
        "offload_param",
        "reduce_bucket_size",
        "overlap_comm",
        "cpu_offload",
        "zenflow",
        *GATHER_16BIT_KEYS,
        *HYBRID_KEYS,
        *QUANTIZED_ZERO_KEYS,
    }
)
OFFLOAD_KEYS = frozenset({"device", "pin_memory"})
OFFLOAD_TUNING_KEYS = frozenset(
    {"buffer_count", "buffer_size", "fast_init", "max_in_cpu", "nvme_path", "pipeline_read", "pipeline_write"}
)
TOP_KEYS = frozenset(
    {
        "zero_optimization",
        "fp16",
        "bf16",
        "gradient_clipping",
        "gradient_accumulation_steps",
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
        "activation_checkpointing",
        "sequence_parallel_size",
        "optimizer",
        "scheduler",
        "communication_data_type",
        "compression",
    }
)
#: DeepSpeed optimizer ``type`` -> the torch class and the ``params`` keys it takes.
OPTIMIZERS = {
    "adam": ("Adam", ("lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam")),
    "adamw": ("AdamW", ("lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam")),
    "sgd": ("SGD", ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
}
SCHEDULERS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": (
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "total_num_steps",
        "last_batch_iteration",
    ),
}


@dataclasses.dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config asks for, split by who applies it. ``None``: the config does not say; ``"auto"``:
    take it from the Trainer."""

    strategy: dict[str, Any]
    """ZeroStrategy keyword arguments (stage, offload, buckets, activation checkpointing)."""
    precision: str | None = None
    """``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"`` (both sections disabled) or ``"auto"``."""
    loss_scale: LossScaleConfig | None = None
    reduce_dtype: str | None = None
    gradient_clip_val: float | str | None = None
    accumulate_grad_batches: int | str | None = None
    micro_batch_size: int | str | None = None
    train_batch_size: int | str | None = None
    optimizer: dict | None = None
    scheduler: dict | None = None


def load_json(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """A dict as given, or the JSON file at a path."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, Path)):
        raise ZeroConfigError(
            f"`config` takes a DeepSpeed config as a dict or the path of its JSON file, got {type(config).__name__} {config!r}."
        )
    path = Path(config)
    if not path.is_file():
        raise ZeroConfigError(f"`config={str(config)!r}`: no such DeepSpeed JSON file.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ZeroConfigError(f"`config={str(config)!r}` is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ZeroConfigError(f"`config={str(config)!r}` must hold a JSON object, got {type(data).__name__}.")
    return data


def _check_keys(section: str, given: Mapping[str, Any], supported: frozenset, tuning: frozenset = frozenset()) -> None:
    """Mapped keys pass, tuning keys pass with a warning, anything else is an error that lists both: a DeepSpeed
    config that works with a warning must not look refused in the list of what is accepted."""
    for key in given:
        if key in supported:
            continue
        if key in tuning:
            rank_zero_warn(
                f"DeepSpeed config: `{section}{key}` tunes DeepSpeed itself and has no effect with ZeroStrategy; ignored."
            )
            continue
        ignored = ""
        if tuning:
            ignored = f" Also accepted and ignored, with a warning (they tune DeepSpeed itself): {sorted(tuning)}."
        raise ZeroConfigError(
            f"DeepSpeed config: `{section}{key}` is not supported by ZeroStrategy.{closest(key, supported | tuning)} "
            f"Supported keys here: {sorted(supported)}.{ignored}"
        )


def _number(name: str, value: Any, kind: type, allow_auto: bool = True) -> Any:
    if value == AUTO and allow_auto:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        expected = 'a number or "auto"' if allow_auto else "a number"
        raise ZeroConfigError(f"DeepSpeed config: `{name}` must be {expected}, got {value!r}.")
    if kind is int and float(value) != int(value):
        raise ZeroConfigError(f"DeepSpeed config: `{name}` must be an integer, got {value!r}.")
    return kind(value)


def _offload(section: str, spec: Any) -> tuple[bool | float, bool | None]:
    """(offload to the host? -- True, False or the optimizer's ``ratio`` --, pin_memory) from an
    ``offload_optimizer``/``offload_param`` section."""
    if spec is None:
        return False, None
    if not isinstance(spec, Mapping):
        raise ZeroConfigError(f"DeepSpeed config: `zero_optimization.{section}` must be an object, got {spec!r}.")
    _check_keys(f"zero_optimization.{section}.", spec, OFFLOAD_KEYS | {"ratio"}, OFFLOAD_TUNING_KEYS)
    device = spec.get("device", "none")
    if device not in ("cpu", "none", None):
        raise ZeroConfigError(
            f"DeepSpeed config: `zero_optimization.{section}.device={device!r}` is not supported; choose 'cpu' or 'none'."
        )
    ratio = spec.get("ratio", 1.0)
    if section != "offload_optimizer" and ratio != 1.0:
        raise ZeroConfigError(
            f"DeepSpeed config: `zero_optimization.{section}.ratio` must be 1.0 (only the optimizer "
            "is partially offloaded)."
        )
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ZeroConfigError(
            f"DeepSpeed config: `zero_optimization.{section}.ratio` must be in (0, 1], got {ratio!r}."
        )
    pin = spec.get("pin_memory")
    if pin is not None and not isinstance(pin, bool):
        raise ZeroConfigError(f"DeepSpeed config: `zero_optimization.{section}.pin_memory` must be true or false.")
    if device != "cpu":
        return False, pin
    return (True if ratio == 1 else float(ratio)), pin


def _zero_section(zero: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys("zero_optimization.", zero, ZERO_KEYS, ZERO_TUNING_KEYS)
    out: dict[str, Any] = {}
    if "stage" in zero:
        stage = zero["stage"]
        if stage not in (1, 2, 3):
            raise ZeroConfigError(
                f"DeepSpeed config: `zero_optimization.stage={stage!r}` is not supported; choose 1, 2 or 3 "
                "(stage 0 is plain data parallelism: use Lightning's 'ddp')."
            )
        out["stage"] = stage
    offload_optimizer, pin_optimizer = _offload("offload_optimizer", zero.get("offload_optimizer"))
    if zero.get("cpu_offload"):  # DeepSpeed's older spelling of optimizer offload
        offload_optimizer = True
    offload_params, pin_params = _offload("offload_param", zero.get("offload_param"))
    if offload_optimizer:
        out["offload_optimizer"] = offload_optimizer
    if offload_params:
        out["offload_params"] = True
    pins = {p for p in (pin_optimizer, pin_params) if p is not None}
    if len(pins) > 1:
        raise ZeroConfigError("DeepSpeed config: `pin_memory` differs between offload_optimizer and offload_param.")
    if pins:
        out["pin_memory"] = pins.pop()
    if zero.get("reduce_bucket_size", AUTO) != AUTO:
        elements = _number("zero_optimization.reduce_bucket_size", zero["reduce_bucket_size"], float)
        out["bucket_size_mb"] = elements * 4 / 2**20  # DeepSpeed counts elements; ours are MiB of fp32
    gather = {zero[key] for key in GATHER_16BIT_KEYS if key in zero}
    if gather:
        if len(gather) > 1 or not all(isinstance(value, bool) for value in gather):
            raise ZeroConfigError(
                f"DeepSpeed config: `zero_optimization.{'/'.join(k for k in GATHER_16BIT_KEYS if k in zero)}` must be "
                "one value, true or false."
            )
        out["gather_16bit_weights_on_save"] = gather.pop()
    if "overlap_comm" in zero:
        if not isinstance(zero["overlap_comm"], bool):
            raise ZeroConfigError("DeepSpeed config: `zero_optimization.overlap_comm` must be true or false.")
        out["overlap_comm"] = zero["overlap_comm"]
    out.update(_hybrid(zero))
    out.update(_zenflow(zero.get("zenflow")))
    return out


#: ``zero_optimization.zenflow``'s keys that map onto selective updates (two with the only values ours has a
#: counterpart for: the choice is by steps, and every step is selective).
ZENFLOW_KEYS = frozenset(
    {"topk_ratio", "update_interval", "select_interval", "select_strategy", "overlap_step", "full_warm_up_rounds"}
)


def _zenflow(spec: Any) -> dict[str, Any]:
    """DeepSpeed ZenFlow -> selective updates: ``topk_ratio`` -> ``offload_topk_ratio``, ``update_interval`` ->
    ``offload_update_interval``, ``select_interval`` -> ``offload_select_interval`` ("auto": ours, every 4 update
    intervals), ``overlap_step`` -> ``offload_overlap_step``. ZenFlow's ``"auto"`` update interval adapts to measured
    timings, so runs would not repeat: an integer is needed ([Note: selective updates] in
    ``engine/offload/selective.py``)."""
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise ZeroConfigError(f"DeepSpeed config: `zero_optimization.zenflow` must be an object, got {spec!r}.")
    _check_keys("zero_optimization.zenflow.", spec, ZENFLOW_KEYS)
    interval = spec.get("update_interval", AUTO)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 2:
        raise ZeroConfigError(
            f"DeepSpeed config: `zero_optimization.zenflow.update_interval` must be an integer >= 2 here, got "
            f"{interval!r}: ZenFlow's 'auto' adapts it to timings, which would make runs differ; selective updates "
            "land the host's step at a fixed step index."
        )
    out: dict[str, Any] = {"offload_update_interval": interval}
    if "topk_ratio" in spec:
        out["offload_topk_ratio"] = _number("zero_optimization.zenflow.topk_ratio", spec["topk_ratio"], float, False)
    select = spec.get("select_interval", AUTO)
    if select != AUTO:
        out["offload_select_interval"] = _number("zero_optimization.zenflow.select_interval", select, int, False)
    overlap = spec.get("overlap_step", True)
    if not isinstance(overlap, bool):
        raise ZeroConfigError("DeepSpeed config: `zero_optimization.zenflow.overlap_step` must be true or false.")
    if not overlap:
        out["offload_overlap_step"] = False
    fixed = {"select_strategy": ("auto", "step"), "full_warm_up_rounds": (0,)}
    for key, allowed in fixed.items():
        if key in spec and (type(spec[key]), spec[key]) not in {(type(value), value) for value in allowed}:
            raise ZeroConfigError(
                f"DeepSpeed config: `zero_optimization.zenflow.{key}={spec[key]!r}` is not supported; allowed: "
                f"{list(allowed)} (columns are chosen by steps, and every step is selective)."
            )
    return out


def _hybrid(zero: Mapping[str, Any]) -> dict[str, Any]:
    """``mics_shard_size`` -> ``shard_size`` (-1, DeepSpeed's default, is off); ``zero_hpz_partition_size`` ->
    ``secondary_shard_size`` (1 is off). ``mics_hierarchical_params_gather`` makes DeepSpeed gather a group that
    spans nodes in two hops; our gathers run over the shard group as one collective, which is the same traffic
    when the group is a node (the case MiCS is made for), so the flag is accepted as a boolean and changes
    nothing, and it needs ``mics_shard_size``."""
    out: dict[str, Any] = {}
    mics = _number("zero_optimization.mics_shard_size", zero.get("mics_shard_size", -1), int, allow_auto=False)
    if mics != -1:
        if mics < 1:
            raise ZeroConfigError(
                f"DeepSpeed config: `zero_optimization.mics_shard_size` must be -1 (off) or >= 1, got {mics}."
            )
        out["shard_size"] = int(mics)
    hierarchical = zero.get("mics_hierarchical_params_gather", False)
    if not isinstance(hierarchical, bool):
        raise ZeroConfigError(
            "DeepSpeed config: `zero_optimization.mics_hierarchical_params_gather` must be true or false."
        )
    if hierarchical and "shard_size" not in out:
        raise ZeroConfigError(
            "DeepSpeed config: `zero_optimization.mics_hierarchical_params_gather` needs `mics_shard_size`."
        )
    hpz = _number(
        "zero_optimization.zero_hpz_partition_size", zero.get("zero_hpz_partition_size", 1), int, allow_auto=False
    )
    if hpz < 1:
        raise ZeroConfigError(f"DeepSpeed config: `zero_optimization.zero_hpz_partition_size` must be >= 1, got {hpz}.")
    if hpz > 1:
        out["secondary_shard_size"] = int(hpz)
    return out


def _precision(config: Mapping[str, Any]) -> tuple[str | None, LossScaleConfig | None]:
    fp16 = config.get("fp16") or {}
    bf16 = config.get("bf16") or {}
    if not isinstance(fp16, Mapping) or not isinstance(bf16, Mapping):
        raise ZeroConfigError("DeepSpeed config: `fp16` and `bf16` must be objects.")
    _check_keys(
        "bf16.", bf16, frozenset({"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_optimizer_states"})
    )
    fp16_on, bf16_on = fp16.get("enabled", False), bf16.get("enabled", False)
    if fp16_on is True and bf16_on is True:
        raise ZeroConfigError("DeepSpeed config: `fp16.enabled` and `bf16.enabled` cannot both be true.")
    try:
        scale = LossScaleConfig.from_deepspeed(fp16) if fp16 else None
    except LossScaleConfigError as err:
        raise ZeroConfigError(f"DeepSpeed config: {err}") from None
    if fp16_on is True:
        return "16-mixed", scale
    if bf16_on is True:
        return "bf16-mixed", None
    if AUTO in (fp16_on, bf16_on):
        return AUTO, scale
    if "fp16" in config or "bf16" in config:
        return "32-true", None
    return None, None


def _state_dtype(bf16: Mapping[str, Any]) -> dict[str, str]:
    """``bf16.bf16_optimizer_states``: the optimizer's moments in bf16 (``optimizer_state_dtype``)."""
    if "bf16_optimizer_states" not in bf16:
        return {}
    value = bf16["bf16_optimizer_states"]
    if not isinstance(value, bool):
        raise ZeroConfigError(f"DeepSpeed config: `bf16.bf16_optimizer_states` must be true or false, got {value!r}.")
    return {"optimizer_state_dtype": "bf16" if value else "fp32"}


def _typed_section(name: str, spec: Any) -> bool:
    """Whether the ``optimizer``/``scheduler`` section is given; if so, it must be ``{type, params}``."""
    if spec is None:
        return False
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ZeroConfigError(f"DeepSpeed config: `{name}` must be an object with a `type` and `params`.")
    _check_keys(f"{name}.", spec, frozenset({"type", "params"}))
    return True


def _optimizer(spec: Any) -> dict | None:
    if not _typed_section("optimizer", spec):
        return None
    kind = str(spec["type"]).lower()
    if kind not in OPTIMIZERS:
        raise ZeroConfigError(
            f"DeepSpeed config: `optimizer.type={spec['type']!r}` is not supported; choose one of "
            f"{sorted(v[0] for v in OPTIMIZERS.values())}.{closest(kind, OPTIMIZERS)}"
        )
    params = dict(spec.get("params") or {})
    _check_keys("optimizer.params.", params, frozenset(OPTIMIZERS[kind][1]))
    return {"type": kind, "params": params}


def _scheduler(spec: Any) -> dict | None:
    if not _typed_section("scheduler", spec):
        return None
    if spec["type"] not in SCHEDULERS:
        raise ZeroConfigError(
            f"DeepSpeed config: `scheduler.type={spec['type']!r}` is not supported; choose one of "
            f"{sorted(SCHEDULERS)}.{closest(str(spec['type']), SCHEDULERS)}"
        )
    params = dict(spec.get("params") or {})
    _check_keys("scheduler.params.", params, frozenset(SCHEDULERS[spec["type"]]))
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ZeroConfigError("DeepSpeed config: `scheduler.params.warmup_type` must be 'log' or 'linear'.")
    return {"type": spec["type"], "params": params}


def parse_deepspeed_config(config: Mapping[str, Any] | str | Path) -> DeepSpeedSettings:
    """Read and check a DeepSpeed-style config (a dict or a JSON path); raise :class:`ZeroConfigError` naming the
    first unsupported key or bad value."""
    data = load_json(config)
    _check_keys("", data, TOP_KEYS, TUNING_KEYS)
    zero = data.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ZeroConfigError("DeepSpeed config: `zero_optimization` must be an object.")
    strategy = _zero_section(zero)
    compression = data.get("compression") or {}
    if not isinstance(compression, Mapping):
        raise ZeroConfigError("DeepSpeed config: `compression` must be an object.")
    _check_keys("compression.", compression, COMPRESSION_KEYS)
    strategy.update(deepspeed_compression(compression, zero))  # with ZeRO++'s zero_quantized_* keys
    if "activation_checkpointing" in data:
        strategy["activation_checkpointing"] = dict(data["activation_checkpointing"])
    if "sequence_parallel_size" in data:
        strategy["sequence_parallel_size"] = data["sequence_parallel_size"]  # ZeroConfig checks the value
    precision, loss_scale = _precision(data)
    strategy.update(_state_dtype(data.get("bf16") or {}))
    reduce_dtype = data.get("communication_data_type")
    if reduce_dtype is not None and reduce_dtype not in ("fp32", "fp16", "bf16"):
        raise ZeroConfigError(
            f"DeepSpeed config: `communication_data_type={reduce_dtype!r}`; choose fp32, fp16 or bf16."
        )
    clip = data.get("gradient_clipping")
    return DeepSpeedSettings(
        strategy=strategy,
        precision=precision,
        loss_scale=loss_scale,
        reduce_dtype=reduce_dtype,
        gradient_clip_val=None if clip is None else _number("gradient_clipping", clip, float),
        accumulate_grad_batches=_positive("gradient_accumulation_steps", data.get("gradient_accumulation_steps")),
        micro_batch_size=_positive("train_micro_batch_size_per_gpu", data.get("train_micro_batch_size_per_gpu")),
        train_batch_size=_positive("train_batch_size", data.get("train_batch_size")),
        optimizer=_optimizer(data.get("optimizer")),
        scheduler=_scheduler(data.get("scheduler")),
    )


def _positive(name: str, value: Any) -> int | str | None:
    if value is None:
        return None
    value = _number(name, value, int)
    if value != AUTO and value < 1:
        raise ZeroConfigError(f"DeepSpeed config: `{name}` must be >= 1, got {value}.")
    return value


# ---------------------------------------------------------------------- optimizer and scheduler
# ---------------------------------------------------------------------- applying to a run
#: The strategy arguments that are :class:`ZeroConfig` fields (validated there, in one place), and their defaults.
CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}


def strategy_settings(
    arguments: Mapping[str, Any], config: Mapping[str, Any] | str | Path | None
) -> tuple[ZeroConfig, DeepSpeedSettings | None]:
    """A strategy's validated settings, the ``Trainer``'s or Fabric's: its keyword arguments completed by the DeepSpeed
    config ``config`` (a dict or a JSON path, checked now), and what that config asks of the rest of the run."""
    deepspeed = parse_deepspeed_config(config) if config is not None else None
    if deepspeed is not None:
        arguments = merge_strategy_arguments(deepspeed, arguments, CONFIG_DEFAULTS)
    return ZeroConfig(**arguments), deepspeed


def merge_strategy_arguments(
    settings: DeepSpeedSettings, given: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict:
    """ZeroStrategy arguments: the explicit ones, completed by the config. An argument left at its default
    takes the config's value; one set to something else must agree with the config."""
    merged = dict(given)
    for key, value in settings.strategy.items():
        explicit = given.get(key, defaults.get(key))
        if key == "activation_checkpointing" and "classes" not in value:
            merged[key] = _merge_activation_checkpointing(value, explicit)  # the argument names the modules
            continue
        if explicit != defaults.get(key) and explicit != value:
            raise ZeroConfigError(
                f"`{key}` is given both in the DeepSpeed config ({value!r}) and as a ZeroStrategy argument "
                f"({explicit!r}); set it in one place."
            )
        merged[key] = value
    return merged


def _merge_activation_checkpointing(section: dict, explicit: Any) -> Any:
    """DeepSpeed's section tunes checkpoint calls the model makes itself, so it names no modules; ZeroStrategy
    needs them: from a ``classes`` entry in the section, or from ``activation_checkpointing=``."""
    if explicit is None:
        raise ZeroConfigError(
            "DeepSpeed config: `activation_checkpointing` does not say which modules to checkpoint; add "
            '"classes": ["your.Block"] to the section, or pass ZeroStrategy(activation_checkpointing=Block).'
        )
    if isinstance(explicit, Mapping):
        return {**section, **explicit}
    return {**section, "classes": explicit}
