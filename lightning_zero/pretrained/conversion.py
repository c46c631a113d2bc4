"""Hugging Face checkpoints whose layout differs from the model's, read row by row.

Transformers 5 holds some weights in another layout than the files on the Hub and its own ``save_pretrained`` write:
a Mixtral (Qwen-MoE, OLMoE, DeepSeek-V3, ...) layer's experts are one ``experts.gate_up_proj`` tensor of shape
``[experts, 2 x intermediate, hidden]`` in the model and ``experts.{e}.w1/w3.weight`` per expert in the file;
``from_pretrained`` converts them with the model's conversion mapping (``transformers.conversion_mapping``). This
module applies the same mapping (transformers' own renaming and ``ConversionOps``) behind :class:`WeightsFile`'s
interface, so ``init_weights`` matches names and shapes as usual. A target whose first operation stacks a list of
tensors along dim 0 (``MergeModulelist(dim=0)``: the experts) is read row by row: a rank reads only its experts'
source tensors; any other conversion reads the whole target and keeps the rank's rows.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from lightning_zero.engine.shard import local_rows, row_range


@dataclasses.dataclass
class _Converted:
    """One model tensor made from several file tensors by ``operations``."""

    converter: Any  # transformers' WeightConverter
    sources: dict[str, list[str]]  # source pattern -> file keys, in list order (expert index)

    def convert(self, read) -> torch.Tensor:
        """``read(file_key)`` for every source, through the converter's operations."""
        return self._run({pattern: [read(key) for key in keys] for pattern, keys in self.sources.items()})

    def convert_rows(self, read, start: int, end: int) -> torch.Tensor:
        return self._run({pattern: [read(key) for key in keys[start:end]] for pattern, keys in self.sources.items()})

    def _run(self, tensors: dict[str, Any]) -> torch.Tensor:
        patterns, targets = list(self.converter.source_patterns), list(self.converter.target_patterns)
        for operation in self.converter.operations:
            tensors = operation.convert(tensors, source_patterns=patterns, target_patterns=targets)
        (out,) = tensors.values()
        return out

    @property
    def stacks_rows(self) -> bool:
        """Whether dim 0 of the result indexes the source lists (the first operation stacks them along it)."""
        first = self.converter.operations[0] if self.converter.operations else None
        return type(first).__name__ == "MergeModulelist" and getattr(first, "dim", None) == 0


class ConvertedWeights:
    """A :class:`~lightning_zero.pretrained.loading.WeightsFile` seen through a Hugging Face model's conversion mapping."""

    def __init__(self, source, transforms: list[Any]) -> None:
        from transformers.core_model_loading import WeightConverter, rename_source_key

        self.source, self.path = source, source.path
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._renamed: dict[str, str] = {}  # model key -> file key
        self._converted: dict[str, _Converted] = {}
        found: dict[str, tuple[Any, dict[str, list[tuple[int, str]]]]] = {}
        for key in source.keys():
            target, pattern = rename_source_key(key, renamings, converters)
            if pattern is None:
                self._renamed[target] = key
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            index = _list_index(pattern, target, key, renamings)
            found.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append((index, key))
        for target, (converter, by_pattern) in found.items():
            sources = {
                p: [key for _, key in sorted(by_pattern[p])] for p in converter.source_patterns if p in by_pattern
            }
            self._converted[target] = _Converted(converter, sources)

    @property
    def converts(self) -> bool:
        return bool(self._converted) or any(model != file for model, file in self._renamed.items())

    def keys(self) -> list[str]:
        return [*self._renamed, *self._converted]

    def shape(self, key: str) -> torch.Size:
        if key in self._renamed:
            return self.source.shape(self._renamed[key])
        return self._converted[key].convert(lambda k: torch.empty(self.source.shape(k), device="meta")).shape

    def rows(self, key: str, rank: int, world: int) -> torch.Tensor:
        if key in self._renamed:
            return self.source.rows(self._renamed[key], rank, world)
        converted = self._converted[key]
        shape = self.shape(key)
        if converted.stacks_rows and len(shape) > 0:
            start, end = row_range(shape, rank, world)
            return converted.convert_rows(self.source.full, start, end)
        return local_rows(converted.convert(self.source.full), rank, world)

    def full(self, key: str) -> torch.Tensor:
        if key in self._renamed:
            return self.source.full(self._renamed[key])
        return self._converted[key].convert(self.source.full)


def _list_index(pattern: str, target: str, key: str, renamings: list[Any]) -> int:
    """The position a file key takes in its converter's list (the number its pattern's ``*`` stands for)."""
    from transformers.core_model_loading import apply_renamings

    renamed = apply_renamings(key, renamings)
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
    if match is None or not match.groups():
        raise ValueError(f"`init_weights`: cannot tell where {key!r} goes in {target!r} (pattern {pattern!r}).")
    return int(match.group(1))


def hugging_face_view(module: nn.Module, source):
    """``source`` through the conversion mapping of the Hugging Face model inside ``module``, when the file's
    layout needs it; else ``source`` itself. Needs no transformers unless the module holds one of its models."""
    hf_model = _hugging_face_model(module)
    if hf_model is None:
        return source
    from transformers.conversion_mapping import get_model_conversion_mapping

    transforms = get_model_conversion_mapping(hf_model)
    if not transforms:
        return source
    converted = ConvertedWeights(source, transforms)
    return converted if converted.converts else source


def _hugging_face_model(module: nn.Module) -> Any:
    """The first ``transformers.PreTrainedModel`` in ``module``, or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
