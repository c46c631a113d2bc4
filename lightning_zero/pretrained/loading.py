"""Pretrained weights into a sharded model, each rank reading only the rows it holds.

Fine-tuning starts from weights someone saved with Hugging Face's ``save_pretrained`` (``model.safetensors``,
or shards listed in ``model.safetensors.index.json``), as one ``.safetensors`` file, as a plain
``state_dict`` / consolidated / Lightning ``.ckpt`` file, or in a sharded checkpoint directory ZeroStrategy wrote
(its model weights only: a new run with a new optimizer, where ``ckpt_path=`` would resume the old one).
Building the full model on every rank and then sharding would defeat ZeRO-3, so the files are memory-mapped and
each rank copies only its dim-0 rows of each tensor (``safetensors``' ``get_slice``, ``torch.load(mmap=True)``): a
rank's resident memory grows by about its shard, and the pages of other ranks' rows are never read. Nothing is
unpickled except through ``torch.load(weights_only=True)`` (see ``checkpoint/safe_load.py``); safetensors holds no
code by design.

Names: the file's keys are matched to the LightningModule's ``state_dict`` names under a prefix (the file of a
``GPT2LMHeadModel`` has ``transformer.h.0...`` where the module built in ``configure_model`` has
``model.transformer.h.0...``), found as the submodule whose names match the most keys unless given. As with
``load_state_dict(strict=True)``, missing and unexpected keys are an error listing them (``strict=False`` to
allow them); a tied parameter (GPT-2's ``lm_head.weight``, which ``save_pretrained`` leaves out) counts as
loaded when the tensor it shares is. Shape mismatches are always an error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, KeysView, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lightning_zero.checkpoint.layout import as_lightning
from lightning_zero.checkpoint.safe_load import load_weights_only
from lightning_zero.checkpoint.sharded_rows import ShardedWeights, is_sharded_directory
from lightning_zero.checkpoint.verify import CheckpointError
from lightning_zero.engine.api import Holding, ShardingEngine
from lightning_zero.engine.shard import local_rows, row_range
from lightning_zero.pretrained.conversion import ConvertedWeights, hugging_face_view

_DIRECTORY_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


class _SliceLike(Protocol):
    """One tensor of an open file: safetensors' ``get_slice`` result, or :class:`_Slice`."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any, /) -> torch.Tensor: ...


class _Handle(Protocol):
    """An open weights file: safetensors' ``safe_open``, or :class:`_TensorDict`."""

    def keys(self) -> Iterable[str]: ...

    def get_slice(self, key: str, /) -> _SliceLike: ...


class WeightsFile:
    """The tensors of a pretrained checkpoint by key, read lazily: shapes, one rank's rows, or whole."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._files: dict[str, Path] = {}  # key -> file holding it
        self._open: dict[Path, _Handle] = {}
        files = self._resolve(self.path)
        for file in files:
            for key in self._handle(file).keys():
                self._files[key] = file

    @staticmethod
    def _resolve(path: Path) -> list[Path]:
        if path.is_file() or is_sharded_directory(path):
            return [path]
        if not path.is_dir():
            raise FileNotFoundError(f"`init_weights`: {path} does not exist.")
        for name in _DIRECTORY_FILES:
            candidate = path / name
            if not candidate.is_file():
                continue
            if name.endswith(".index.json"):
                weight_map = json.loads(candidate.read_text())["weight_map"]
                return sorted({path / file for file in weight_map.values()})
            return [candidate]
        raise FileNotFoundError(
            f"`init_weights`: {path} holds none of {_DIRECTORY_FILES} (a `save_pretrained` "
            "directory), nor a sharded checkpoint's .metadata."
        )

    def _handle(self, file: Path) -> _Handle:
        handle = self._open.get(file)
        if handle is None:
            if is_sharded_directory(file):
                handle = ShardedWeights(file)
            elif file.suffix == ".safetensors":
                from safetensors import safe_open

                handle = safe_open(str(file), framework="pt", device="cpu")
            else:
                state = load_weights_only(file, mmap=True)
                if isinstance(state, dict):
                    state = as_lightning(state)  # a Fabric loop's full file keeps the module under the loop's key
                if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
                    state = state["state_dict"]  # a Lightning checkpoint
                if not isinstance(state, Mapping):
                    raise CheckpointError(f"`init_weights`: {file} holds a {type(state).__name__}, not a state_dict.")
                handle = _TensorDict({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
            self._open[file] = handle
        return handle

    def keys(self) -> list[str]:
        return list(self._files)

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self._handle(self._files[key]).get_slice(key).get_shape())

    def rows(self, key: str, rank: int, world: int) -> torch.Tensor:
        """``rank``'s dim-0 rows (``engine/shard.py``), reading nothing else."""
        tensor_slice = self._handle(self._files[key]).get_slice(key)
        shape = tensor_slice.get_shape()
        if not shape:
            return local_rows(tensor_slice[...], rank, world)
        start, end = row_range(shape, rank, world)
        return tensor_slice[start:end]

    def full(self, key: str) -> torch.Tensor:
        return self._handle(self._files[key]).get_slice(key)[...]


class _TensorDict:
    """A memory-mapped ``torch.load`` result with safetensors' ``keys``/``get_slice`` interface."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def keys(self) -> KeysView[str]:
        return self.tensors.keys()

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self.tensors[key])


class _Slice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index].clone()  # a copy: the view would keep the whole mapping alive


def detect_prefix(module: nn.Module, keys: list[str]) -> str:
    """The submodule prefix under which the most of ``keys`` name entries of ``module.state_dict()``."""
    live = set(module.state_dict())
    candidates = [""] + [f"{name}." for name, _ in module.named_modules() if name]
    return max(candidates, key=lambda prefix: (sum(prefix + key in live for key in keys), -len(prefix)))


def match_keys(
    module: nn.Module, source: WeightsFile | ConvertedWeights, *, prefix: str | None = None, strict: bool = True
) -> dict[str, str]:
    """Live ``state_dict`` name -> source key, after checking names and shapes (see the module docstring)."""
    keys = source.keys()
    prefix = detect_prefix(module, keys) if prefix is None else prefix
    live = module.state_dict()
    target = {name for name in live if name.startswith(prefix)}
    sources = {prefix + key: key for key in keys if prefix + key in live}
    mismatched = [
        f"{key}: file {tuple(source.shape(key))} vs model {tuple(live[name].shape)}"
        for name, key in sources.items()
        if tuple(source.shape(key)) != tuple(live[name].shape)
    ]
    # A tied parameter is loaded when any of its names is (save_pretrained keeps one of them).
    aliases: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    loaded_ids = {id(p) for name, p in module.named_parameters(remove_duplicate=False) if name in sources}
    named = dict(module.named_parameters(remove_duplicate=False))
    missing = sorted(name for name in target - set(sources) if not (name in named and id(named[name]) in loaded_ids))
    unexpected = sorted(key for key in keys if prefix + key not in live)
    if mismatched or (strict and (missing or unexpected)):
        lines = [f"`init_weights={str(source.path)!r}` does not match the model (under the prefix {prefix!r}):"]
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mismatched shapes", mismatched)):
            if names:
                lines.append(f"  {label} ({len(names)}): {', '.join(names)}")
        if not mismatched:
            lines.append("Pass `init_weights_strict=False` to load the keys that match (or `init_weights_prefix=`).")
        raise CheckpointError("\n".join(lines))
    return sources


def _matched(module: nn.Module, keys: list[str], prefix: str | None) -> int:
    """How many of ``keys`` name an entry of ``module.state_dict()`` under ``prefix`` (found when None)."""
    prefix = detect_prefix(module, keys) if prefix is None else prefix
    live = set(module.state_dict())
    return sum(prefix + key in live for key in keys)


def load_pretrained(
    module: nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    prefix: str | None = None,
    engine: ShardingEngine | None = None,
    holding: Holding | None = None,
) -> dict[str, str]:
    """Copy pretrained weights from ``path`` into ``module`` (a plain module, or one ZeroStrategy's ``engine``
    shards), each rank reading only its rows; returns which live name came from which key. ZeroStrategy calls
    it for ``init_weights=``; call it yourself for other entry points (it needs no process group without an
    engine). Collective when ``engine`` is given. ``holding``: the tensors this rank holds under pipeline
    stages (default: the engine's, else all)."""
    from lightning_zero.checkpoint.io import copy_into_model

    source: WeightsFile | ConvertedWeights = WeightsFile(path)
    view = hugging_face_view(module, source)
    if view is not source and _matched(module, view.keys(), prefix) > _matched(module, source.keys(), prefix):
        source = view  # a Hub layout of a model transformers holds otherwise (``pretrained_conversion.py``)
    sources = match_keys(module, source, prefix=prefix, strict=strict)
    holding = holding if holding is not None else engine.holding if engine is not None else Holding()
    copy_into_model(module, engine, sources, source.rows, source.full, holding)
    return sources
