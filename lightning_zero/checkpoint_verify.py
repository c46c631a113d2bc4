"""Checks that run before a checkpoint is read, so bad input fails with a clear error and nothing in the
live model or optimizer has been modified yet.

* integrity: a ``manifest.json`` written with the checkpoint lists every file's size and CRC-32; a
  truncated or corrupted file is named;
* completeness: a directory still being written (its temporary sibling exists) is reported as such;
* compatibility: the parameter names and shapes in the checkpoint are compared with the model's, and
  every missing, unexpected or mismatched name is listed.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

MANIFEST_FILE = "manifest.json"
META_FILE = "meta.pt"


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message says which file or which parameters and why."""


def crc32(path: Path, chunk: int = 1 << 22) -> int:
    value = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            value = zlib.crc32(block, value)
    return value


def describe_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, int]]:
    return {name: {"bytes": (directory / name).stat().st_size, "crc32": crc32(directory / name)} for name in names}


def write_manifest(directory: Path, files: Mapping[str, Mapping[str, int]]) -> None:
    (directory / MANIFEST_FILE).write_text(json.dumps({"format": "lightning_zero.sharded/1", "files": dict(files)}, indent=1))


def check_complete(path: Path) -> None:
    """Raise if ``path`` is not a finished checkpoint (missing, still being written, or not ours)."""
    if not path.exists():
        writing = sorted(p.name for p in path.parent.glob(f".{path.name}.tmp-*")) if path.parent.exists() else []
        if writing:
            raise CheckpointError(
                f"Checkpoint {path} is still being written (or its writer died): found {writing[0]} in {path.parent}."
            )
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    if path.is_dir() and not (path / MANIFEST_FILE).is_file():
        raise CheckpointError(
            f"{path} is not a lightning_zero checkpoint directory: it has no {MANIFEST_FILE} "
            f"(a sharded checkpoint holds {MANIFEST_FILE}, {META_FILE} and the shard files)."
        )


def verify_files(path: Path, names: Iterable[str] | None = None) -> None:
    """Compare the files of a sharded checkpoint (all, or ``names``) with its manifest."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())["files"]
    for name in names if names is not None else sorted(manifest):
        expected = manifest[name]
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"Checkpoint {path} is missing its file {name}.")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"Checkpoint file {file} is truncated or was modified: {size} bytes, expected {expected['bytes']}."
            )
        if crc32(file) != expected["crc32"]:
            raise CheckpointError(f"Checkpoint file {file} is corrupted: its CRC-32 does not match the manifest.")


def saved_tensor_shapes(path: Path, prefix: str) -> dict[str, torch.Size | None]:
    """Entries under ``prefix.`` in a sharded checkpoint: name -> full shape (None for non-tensors)."""
    from lightning_zero.safe_load import read_dcp_metadata  # it builds on this module's CheckpointError

    metadata = read_dcp_metadata(path / ".metadata").state_dict_metadata
    out = {}
    for key, item in metadata.items():
        if key.startswith(prefix + "."):
            out[key[len(prefix) + 1 :]] = item.size if isinstance(item, TensorStorageMetadata) else None
    return out


def check_compatible(
    saved: Mapping[str, torch.Size | None], live: Mapping[str, torch.Size | None], what: str, strict: bool = True
) -> None:
    """List every missing, unexpected and shape-mismatched name between a checkpoint and the live object."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    mismatched = sorted(
        f"{name}: checkpoint {tuple(saved[name])} vs {tuple(live[name])}"
        for name in set(saved) & set(live)
        if saved[name] is not None and live[name] is not None and tuple(saved[name]) != tuple(live[name])
    )
    if mismatched or (strict and (missing or unexpected)):
        lines = [f"The checkpoint does not match the {what}:"]
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mismatched shapes", mismatched)):
            if names:
                lines.append(f"  {label} ({len(names)}): {', '.join(names)}")
        raise CheckpointError("\n".join(lines))
