"""Communication compression settings: their names, their checks, and the DeepSpeed keys that set them.

What travels in the gradient reduce-scatter and the parameter all-gathers can be 16-bit or block-wise quantized
(ZeRO++'s qgZ and qwZ); fp32 master weights and the optimizer stay exact. The engine does the compressing;
this module only names and checks the :class:`~lightning_zero.ZeroConfig` fields (``gradient_compression``,
``param_compression``, ``quantization_scheme``, ``quantization_block_size``, ``error_feedback``,
``compression_scope``), before any process group exists, and maps DeepSpeed's ``compression`` block and
``zero_optimization.zero_quantized_*`` keys onto them (``deepspeed_compat/config.py`` checks which keys a block may hold).
Split from ``zero_config.py`` and ``deepspeed_compat/config.py`` to keep each under 400 lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from lightning_zero.config.choices import ZeroConfigError, check_choice, closest

if TYPE_CHECKING:
    from lightning_zero.config.zero_config import ZeroConfig

#: How gradients or parameters travel: a 16-bit dtype, or block-wise quantized integers with fp32 scales.
Compression = Literal["fp16", "bf16", "int8", "int4"]
QuantizationScheme = Literal["symmetric", "asymmetric"]
CompressionScope = Literal["all", "inter_node"]

COMPRESSIONS = (None, "fp16", "bf16", "int8", "int4")
QUANTIZED = ("int8", "int4")
QUANTIZATION_SCHEMES = ("symmetric", "asymmetric")
COMPRESSION_SCOPES = ("all", "inter_node")

#: The keys of a DeepSpeed-style ``compression`` block.
COMPRESSION_KEYS = frozenset(
    {"enabled", "compression_type", "quantization_type", "quantization_bits", "error_feedback", "all_gather_fp16"}
)
#: ZeRO++ switches in ``zero_optimization``: qwZ, qgZ, and frozen weights kept quantized (only ``false`` accepted).
QUANTIZED_ZERO_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights")
_QUANTIZATION_TYPES = {"symmetric_quantization_signed": "symmetric", "asymmetric_quantization_signed": "asymmetric"}
_COMPRESSION_TYPES = ("fp16", "bf16", "none")
_BITS = (8, 4, 16, 32)  # 16 and 32: not quantized


def check_compression(config: ZeroConfig) -> None:
    """Raise a :class:`ZeroConfigError` naming the setting, the allowed values and the fix for a compression
    setting ``config`` cannot honour (called by ``ZeroConfig.__post_init__``, after ``shard_size`` is typed)."""
    check_choice("gradient_compression", config.gradient_compression, COMPRESSIONS)
    check_choice("param_compression", config.param_compression, COMPRESSIONS)
    check_choice("quantization_scheme", config.quantization_scheme, QUANTIZATION_SCHEMES)
    check_choice("compression_scope", config.compression_scope, COMPRESSION_SCOPES)
    size = config.quantization_block_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 2 or size % 2:
        raise ZeroConfigError(
            f"`quantization_block_size` must be an even integer >= 2 (the elements that share one fp32 scale; int4 "
            f"packs two per byte), got {size!r}. The default is 2048."
        )
    if config.error_feedback and config.gradient_compression not in QUANTIZED:
        raise ZeroConfigError(
            f"`error_feedback=True` with `gradient_compression={config.gradient_compression!r}`: error feedback needs "
            "quantized gradients: set gradient_compression='int8' or 'int4', or error_feedback=False."
        )
    if config.compression_scope != "inter_node":
        return
    if config.param_compression is not None:
        raise ZeroConfigError(
            f"`compression_scope='inter_node'` with `param_compression={config.param_compression!r}`: under hybrid "
            "sharding parameters are gathered inside a shard group, never across nodes, so only gradients cross them. "
            "Set param_compression=None, or compression_scope='all' to compress every collective."
        )
    if config.gradient_compression is None:
        raise ZeroConfigError(
            "`compression_scope='inter_node'` has nothing to compress: `gradient_compression` is None. Set "
            f"gradient_compression to one of {COMPRESSIONS[1:]}, or leave compression_scope='all'."
        )
    if config.shard_size is None:
        raise ZeroConfigError(
            "`compression_scope='inter_node'` compresses the traffic between the replica groups of hybrid sharding, "
            "but `shard_size=None` shards flat over every rank, with no separate inter-node traffic. Set shard_size "
            "(e.g. 'node') or use compression_scope='all'."
        )


# ---------------------------------------------------------------------- DeepSpeed keys
def deepspeed_compression(block: Mapping[str, Any], zero: Mapping[str, Any]) -> dict[str, Any]:
    """ZeroStrategy arguments from a ``compression`` block (its keys already checked against
    :data:`COMPRESSION_KEYS`) and ZeRO++'s ``zero_optimization.zero_quantized_*`` switches. Where both set the same
    argument to different values, a :class:`ZeroConfigError` names both keys."""
    found: dict[str, tuple[Any, str]] = {}  # argument -> (value, the key that set it, as written in the JSON)
    for argument, value, key in (*_compression_block(block), *_quantized_zero(zero)):
        if argument in found and found[argument][0] != value:
            earlier, where = found[argument]
            raise ZeroConfigError(
                f"DeepSpeed config: `{where}` and `{key}` ask for different `{argument}` ({earlier!r} and {value!r}); "
                "set it in one place."
            )
        found[argument] = (value, key)
    return {argument: value for argument, (value, _) in found.items()}


def _written(section: str, key: str, value: Any) -> str:
    return f"{section}.{key}={json.dumps(value)}"


def _compression_block(block: Mapping[str, Any]) -> Iterator[tuple[str, Any, str]]:
    """``(argument, value, key)`` for each ZeroStrategy argument the block sets; nothing when ``enabled`` is false
    (the block's values are checked all the same). ``quantization_bits`` 8 or 4 picks int8/int4 gradients, 16 or
    32 leaves ``compression_type`` ("none": not compressed) to decide; ``all_gather_fp16`` sends fp16 parameters."""
    for key in ("enabled", "error_feedback", "all_gather_fp16"):
        if key in block and not isinstance(block[key], bool):
            raise ZeroConfigError(f"DeepSpeed config: `compression.{key}` must be true or false, got {block[key]!r}.")
    kind = block.get("compression_type", "none")
    if kind not in _COMPRESSION_TYPES:
        raise ZeroConfigError(
            f"DeepSpeed config: `compression.compression_type={kind!r}` is not supported; choose one of "
            f"{list(_COMPRESSION_TYPES)}.{closest(str(kind), _COMPRESSION_TYPES)}"
        )
    scheme = block.get("quantization_type", "symmetric_quantization_signed")
    if scheme not in _QUANTIZATION_TYPES:
        spelled = {v: k for k, v in _QUANTIZATION_TYPES.items()}.get(scheme)  # our name for it, e.g. "asymmetric"
        raise ZeroConfigError(
            f"DeepSpeed config: `compression.quantization_type={scheme!r}` is not supported; choose one of "
            f"{sorted(_QUANTIZATION_TYPES)}."
            + (f" Did you mean {spelled!r}?" if spelled else closest(str(scheme), _QUANTIZATION_TYPES))
        )
    bits = block.get("quantization_bits", 32)
    if type(bits) is not int or bits not in _BITS:
        raise ZeroConfigError(
            f"DeepSpeed config: `compression.quantization_bits={bits!r}` is not supported; choose 8 or 4 (block-wise "
            "quantized) or 16 or 32 (not quantized: `compression_type` decides)."
        )
    if not block.get("enabled", True):
        return
    if bits in (4, 8):
        yield "gradient_compression", f"int{bits}", _written("compression", "quantization_bits", bits)
    elif "compression_type" in block or "quantization_bits" in block:
        key = "compression_type" if "compression_type" in block else "quantization_bits"
        yield "gradient_compression", None if kind == "none" else kind, _written("compression", key, block[key])
    if "quantization_type" in block:
        yield "quantization_scheme", _QUANTIZATION_TYPES[scheme], _written("compression", "quantization_type", scheme)
    if "error_feedback" in block:
        yield (
            "error_feedback",
            block["error_feedback"],
            _written("compression", "error_feedback", block["error_feedback"]),
        )
    if block.get("all_gather_fp16"):
        yield "param_compression", "fp16", _written("compression", "all_gather_fp16", True)


def _quantized_zero(zero: Mapping[str, Any]) -> Iterator[tuple[str, Any, str]]:
    """ZeRO++'s qwZ (``zero_quantized_weights``) and qgZ (``zero_quantized_gradients``): int8 parameters and
    gradients in transit; ``false`` sets nothing."""
    for key in QUANTIZED_ZERO_KEYS:
        if key in zero and not isinstance(zero[key], bool):
            raise ZeroConfigError(
                f"DeepSpeed config: `zero_optimization.{key}` must be true or false, got {zero[key]!r}."
            )
    if zero.get("zero_quantized_nontrainable_weights"):
        raise ZeroConfigError(
            "DeepSpeed config: `zero_optimization.zero_quantized_nontrainable_weights` (frozen weights kept quantized "
            "in memory) is not supported by ZeroStrategy; remove it or set it to false. `zero_quantized_weights` "
            "(int8 parameters in the all-gathers) is supported."
        )
    for key, argument in (
        ("zero_quantized_weights", "param_compression"),
        ("zero_quantized_gradients", "gradient_compression"),
    ):
        if zero.get(key):
            yield argument, "int8", _written("zero_optimization", key, True)
