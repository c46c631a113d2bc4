"""Trained weights back into the Hugging Face ecosystem: a directory ``from_pretrained`` reads.

A checkpoint of a LightningModule that holds a ``transformers`` model describes it (:func:`describe`: the
model's class, its config and the prefix of its names in the module, e.g. ``model.``), so that
``lightning-zero consolidate CKPT OUT --hf`` needs nothing else. The export writes ``config.json`` and
``model.safetensors`` (or shards of at most ``max_shard_size`` bytes with ``model.safetensors.index.json``,
holding one shard in memory at a time), keys without the module's prefix, and leaves out the aliases of tied
parameters (GPT-2's ``lm_head.weight``), as ``save_pretrained`` does. The directory appears under its name
only when complete (temporary sibling, then rename).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b)?\s*$", re.IGNORECASE)


def find_hf_model(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(prefix, model) of the outermost ``transformers.PreTrainedModel`` inside ``module``, if any."""
    library = sys.modules.get("transformers")
    pretrained = getattr(library, "PreTrainedModel", None) if library is not None else None
    if pretrained is None:
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, pretrained):
            return (f"{name}." if name else ""), sub
    return None


def describe(module: nn.Module) -> dict[str, Any] | None:
    """What an export needs to know of the module's Hugging Face model, in plain JSON types (a checkpoint
    stores it and loads it back with ``weights_only=True``); None when there is none."""
    found = find_hf_model(module)
    if found is None:
        return None
    prefix, model = found
    seen: set[int] = set()
    tied: list[str] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.append(name)
        seen.add(id(param))
    config = json.loads(getattr(model, "config").to_json_string(use_diff=False))  # a PreTrainedModel's
    return {"class": type(model).__name__, "prefix": prefix, "config": config, "tied": tied}


def describe_config_dir(directory: str | os.PathLike, prefix: str = "") -> dict[str, Any]:
    """The same description from a directory holding a ``config.json`` (e.g. the pretrained model's)."""
    config = json.loads((Path(directory) / "config.json").read_text())
    classes = config.get("architectures") or []
    return {"class": classes[0] if classes else None, "prefix": prefix, "config": config, "tied": _tied_keys(config)}


def _tied_keys(config: Mapping[str, Any]) -> list[str]:
    """Tied aliases of a model built from ``config`` (on the meta device; nothing is allocated)."""
    classes = config.get("architectures") or []
    library = __import__("transformers")
    cls = getattr(library, classes[0], None) if classes else None
    if cls is None:
        return []
    with torch.device("meta"):
        model = cls(library.AutoConfig.for_model(**config))
    description = describe(model)
    if description is None:
        raise TypeError(f"{classes[0]} (the config's architecture) is not a transformers PreTrainedModel.")
    return description["tied"]


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MiB"``, ``1000000`` -> bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"Cannot read the size {text!r}; write e.g. '5GB' or '500MiB'.")
    unit = (match.group(2) or "b").lower()
    scale = {
        "b": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }[unit]
    return int(float(match.group(1)) * scale)


def write_hf_dir(
    tensors: Iterable[tuple[str, torch.Tensor]],
    record: Mapping[str, Any],
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write ``(name, tensor)`` pairs (the LightningModule's names) as a Hugging Face directory ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    prefix, tied, limit = record.get("prefix", ""), set(record.get("tied", ())), parse_size(max_shard_size)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        shard: dict[str, torch.Tensor] = {}
        size = total = 0
        files: list[str] = []
        weight_map: dict[str, str] = {}

        def flush() -> None:
            nonlocal shard, size
            if shard:
                name = f"part-{len(files):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                files.append(name)
                weight_map.update(dict.fromkeys(shard, name))
            shard, size = {}, 0

        for name, tensor in tensors:
            if not name.startswith(prefix) or name[len(prefix) :] in tied:
                continue
            cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            tensor = tensor.detach().to("cpu", dtype=cast).contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > limit:
                flush()
            shard[name[len(prefix) :]] = tensor
            size, total = size + nbytes, total + nbytes
        flush()
        if len(files) == 1:
            os.replace(tmp / files[0], tmp / "model.safetensors")
        else:
            count = len(files)
            for i, name in enumerate(files):
                final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                os.replace(tmp / name, tmp / final)
                weight_map = {k: (final if v == name else v) for k, v in weight_map.items()}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if record.get("config") is not None:
            config = dict(record["config"])
            if record.get("class"):
                config["architectures"] = [record["class"]]
            if dtype is not None:
                config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def sixteen_bit_dir(checkpoint: str | os.PathLike) -> Path:
    """Where ``gather_16bit_weights_on_save`` writes the 16-bit weights of ``checkpoint``."""
    path = Path(checkpoint)
    return path.with_name(path.name + ".hf")


def save_16bit(
    state: Mapping[str, torch.Tensor],
    record: Mapping[str, Any] | None,
    checkpoint: str | os.PathLike,
    dtype: torch.dtype,
) -> Path:
    """``gather_16bit_weights_on_save``: the full ``state`` in ``dtype`` next to ``checkpoint``: a Hugging Face
    directory when the module holds a ``transformers`` model (``record``), else ``model.safetensors`` alone
    under the module's own names."""
    return write_hf_dir(
        state.items(), record or {"prefix": "", "config": None}, sixteen_bit_dir(checkpoint), dtype=dtype
    )
