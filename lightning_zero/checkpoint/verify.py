"""Checks that run before a checkpoint is read, so bad input fails with a clear error and nothing in the
live model or optimizer has been modified yet.

* integrity: a ``manifest.json`` written with the checkpoint lists every file's size and CRC-32; a
  truncated or corrupted file is named, and so is a damaged manifest. A full checkpoint (one torch zip
  archive) is checked against the CRC-32 of each of its records;
* completeness: a directory still being written (its temporary sibling exists) is reported as such;
* compatibility: the parameter names and shapes in the checkpoint are compared with the model's, and
  every missing, unexpected or mismatched name is listed.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_zero.checkpoint.files import temporaries_of
from lightning_zero.checkpoint.layout import as_lightning

MANIFEST_FILE = "manifest.json"
META_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"
MANIFEST_FORMAT = "lightning_zero.sharded/1"


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


def manifest_text(files: Mapping[str, Mapping[str, int]]) -> str:
    return json.dumps({"format": MANIFEST_FORMAT, "files": dict(files)}, indent=1)


def write_manifest(directory: Path, files: Mapping[str, Mapping[str, int]]) -> None:
    (directory / MANIFEST_FILE).write_text(manifest_text(files))


def read_manifest(path: Path) -> dict[str, dict[str, int]]:
    """``file name -> {"bytes", "crc32"}`` from the manifest of the sharded checkpoint ``path``.

    The manifest is the first file a reader trusts, so its form is checked here and a damaged one names
    itself (rather than surfacing later as a ``KeyError``); names must be plain file names, so a manifest
    can never point a reader outside its directory.
    """
    file = path / MANIFEST_FILE
    try:
        manifest = json.loads(file.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete sharded checkpoint: it has no {MANIFEST_FILE}.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file} is damaged: it is not valid JSON ({err}).") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    form = manifest.get("format") if isinstance(manifest, dict) else None
    if form != MANIFEST_FORMAT:
        if isinstance(form, str) and form.startswith("lightning_zero.sharded/"):
            raise CheckpointError(
                f"{file} has format {form!r}; this version of lightning_zero reads {MANIFEST_FORMAT!r}."
            )
        raise CheckpointError(f"{file} is damaged or not a lightning_zero manifest: its format is {form!r}.")
    if not isinstance(files, dict):
        raise CheckpointError(f"{file} is damaged: it has no table of files.")
    for name, entry in files.items():
        if not _plain_file_name(name):
            raise CheckpointError(f"{file} is damaged: it lists {name!r}, which is not a file name in the checkpoint.")
        if not (isinstance(entry, dict) and set(entry) == {"bytes", "crc32"} and all(map(_count, entry.values()))):
            raise CheckpointError(f"{file} is damaged: its entry for {name} is {entry!r}, not a size and a CRC-32.")
    for required in (DCP_METADATA_FILE, META_FILE):
        if required not in files:
            raise CheckpointError(f"{file} is damaged: it does not list {required}, which every sharded checkpoint has")
    return files


def _plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_complete(path: Path) -> None:
    """Raise if ``path`` is not a finished checkpoint (missing, still being written, or not ours)."""
    if not path.exists():
        writing = sorted(p.name for p, kind in temporaries_of(path) if kind == "tmp")
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


def verify_files(path: Path, names: Iterable[str] | None = None, *, checksums: bool = True) -> None:
    """Compare the files of a sharded checkpoint with its manifest: every file (and no shard file the manifest
    does not list), or only ``names``; sizes always, CRC-32s unless ``checksums=False``."""
    manifest = read_manifest(path)
    if names is None:
        names = sorted(manifest)
        check_listed(path, manifest)
    for name in names:
        expected = manifest[name]
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"Checkpoint {path} is missing its file {name} (listed in {MANIFEST_FILE}).")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"Checkpoint file {file} is truncated or was modified: {size} bytes, {MANIFEST_FILE} records "
                f"{expected['bytes']}."
            )
        if checksums and (actual := crc32(file)) != expected["crc32"]:
            raise CheckpointError(
                f"Checkpoint file {file} is corrupted: its CRC-32 is {actual:#010x}, {MANIFEST_FILE} records "
                f"{expected['crc32']:#010x}."
            )


def check_listed(path: Path, manifest: Mapping[str, object]) -> None:
    """Every shard and metadata file in the directory must be in the manifest (a damaged manifest that lost a
    name, or a file dropped in later, would otherwise go unchecked)."""
    for file in sorted(path.iterdir()):
        if file.name not in manifest and (file.suffix == ".distcp" or file.name in (DCP_METADATA_FILE, META_FILE)):
            raise CheckpointError(
                f"Checkpoint file {file} is not listed in {path / MANIFEST_FILE}: the manifest is damaged or the "
                "file does not belong to this checkpoint."
            )


def verify_archive(path: Path, records: Iterable[str] | None = None) -> list[str]:
    """Check a full checkpoint (a torch zip archive) against the CRC-32 each record carries; returns the
    record names. ``torch.load`` itself does not check them: a flipped byte in a tensor loads silently."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            for name in names if records is None else records:
                with archive.open(name) as record:
                    while record.read(1 << 22):
                        pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, KeyError, ValueError, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        if "CRC-32" in str(err) or "Bad CRC" in str(err):
            raise CheckpointError(f"Checkpoint file {path} is corrupted: {err}.") from None
        raise CheckpointError(
            f"Checkpoint file {path} is damaged or truncated: it is not a complete torch archive ({err})."
        ) from None
    return names


def read_checkpoint_dict(file: Path, **kwargs) -> dict:
    """A checkpoint's ``torch.save`` file (``meta.pt``, a full checkpoint), read without executing code, in Lightning's
    layout (``layout.py``); any
    failure to parse it names the file (checksums catch damage first, this catches what they cannot: a file
    that was never a checkpoint)."""
    from lightning_zero.checkpoint.safe_load import load_weights_only  # it builds on this module's CheckpointError

    try:
        checkpoint = load_weights_only(file, **kwargs)
    except CheckpointError:
        raise
    except Exception as err:  # damaged bytes surface as many types from the unpickler and the zip reader
        raise CheckpointError(
            f"Cannot read {file}: it is damaged or not a checkpoint ({type(err).__name__}: {err})."
        ) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{file} holds a {type(checkpoint).__name__}, not a checkpoint's dict.")
    return as_lightning(checkpoint)  # a full file a Fabric loop wrote under its own keys (layout.py)


def saved_tensor_shapes(path: Path, prefix: str) -> dict[str, torch.Size | None]:
    """Entries under ``prefix.`` in a sharded checkpoint: name -> full shape (None for non-tensors)."""
    from lightning_zero.checkpoint.safe_load import read_dcp_metadata  # it builds on this module's CheckpointError

    metadata = read_dcp_metadata(path / DCP_METADATA_FILE).state_dict_metadata
    out = {}
    for key, item in metadata.items():
        if key.startswith(prefix + "."):
            out[key[len(prefix) + 1 :]] = item.size if isinstance(item, TensorStorageMetadata) else None
    return out


def check_compatible(
    saved: Mapping[str, torch.Size | None],
    live: Mapping[str, torch.Size | None],
    what: str,
    strict: bool = True,
    checkpoint: Path | None = None,
) -> None:
    """List every missing, unexpected and shape-mismatched name between a checkpoint and the live object."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    mismatched = sorted(
        f"{name}: checkpoint {tuple(stored)} vs {tuple(current)}"
        for name in set(saved) & set(live)
        if (stored := saved[name]) is not None
        and (current := live[name]) is not None
        and tuple(stored) != tuple(current)
    )
    if mismatched or (strict and (missing or unexpected)):
        lines = [f"The checkpoint{f' {checkpoint}' if checkpoint else ''} does not match the {what}:"]
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mismatched shapes", mismatched)):
            if names:
                lines.append(f"  {label} ({len(names)}): {', '.join(names)}")
        raise CheckpointError("\n".join(lines))
