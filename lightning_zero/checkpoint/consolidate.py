"""Turn a sharded checkpoint directory into one plain ``state_dict`` file, one tensor at a time.

No process group is needed (it runs in a single process, anywhere). The output is an ordinary
``torch.save`` file that ``torch.load(dst, weights_only=True)`` reads into a dict of full tensors, and
``model.load_state_dict`` accepts as is.

[Note: streaming the output file]
``torch.save`` needs every tensor in memory at once. Instead the file is first written with
``torch.serialization.skip_data`` from shape-only (fake) tensors, which lays out the archive with space
reserved for every tensor; then, for one tensor at a time, the shards are read with
``torch.distributed.checkpoint`` into a full-size buffer and copied into the file through a shared memory
map (``torch.load(mmap=True)`` with ``MAP_SHARED``), which is closed before the next tensor. Peak memory is
about the largest tensor, not the model.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_zero.checkpoint.files import remove, temporary_path
from lightning_zero.checkpoint.safe_load import dcp_load_here, read_dcp_metadata
from lightning_zero.checkpoint.verify import (
    META_FILE,
    CheckpointError,
    check_complete,
    read_checkpoint_dict,
    verify_archive,
    verify_files,
)
from lightning_zero.torch_versions.tracing import FakeTensorMode


def _entries(src: Path, prefix: str) -> Iterator[tuple[str, TensorStorageMetadata]]:
    metadata = read_dcp_metadata(src / ".metadata").state_dict_metadata
    for key, item in metadata.items():
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            yield key, item


def consolidate(src: str | os.PathLike, dst: str | os.PathLike, *, include_optimizer: bool = False) -> Path:
    """Write the full model ``state_dict`` of the sharded checkpoint ``src`` to the file ``dst``.

    Tensors only: non-tensor entries (a module's ``get_extra_state``) would need unpickling arbitrary
    objects, which this safe format never does.

    With ``include_optimizer=True`` the file holds ``{"state_dict": ..., "optimizer_states": [...]}`` where
    each optimizer state is in ``torch.optim`` format (integer keys in ``param_groups`` order), loadable by
    ``optimizer.load_state_dict`` of the unsharded model's optimizer.
    """
    src, dst = Path(src), Path(dst)
    check_complete(src)
    if not src.is_dir():
        raise ValueError(f"{src} is a single-file checkpoint already; consolidate takes a sharded directory.")
    verify_files(src)
    meta = read_checkpoint_dict(src / META_FILE)

    # key in the DCP archive -> (path of keys in the output object, metadata)
    layout: dict[str, tuple[tuple, TensorStorageMetadata]] = {}
    for key, item in _entries(src, "state_dict."):
        name = key[len("state_dict.") :]
        layout[key] = (("state_dict", name) if include_optimizer else (name,), item)
    optimizer_states = []
    if include_optimizer and not meta.get("optimizer_param_groups"):
        raise ValueError(
            f"{src} holds no optimizer state (saved with `weights_only=True`, or by a run without an optimizer): "
            "there is nothing for `include_optimizer` (`--optimizer`) to write; consolidate the weights without it."
        )
    if include_optimizer:
        for i, groups in enumerate(meta.get("optimizer_param_groups", [])):
            index = {name: n for n, name in enumerate(name for g in groups for name in g["params"])}
            state: dict[int, dict] = {}
            for key, item in _entries(src, f"optimizer_{i}."):
                param, field = key[len(f"optimizer_{i}.") :].rsplit(".", 1)
                state.setdefault(index[param], {})[field] = None
                layout[key] = (("optimizer_states", i, "state", index[param], field), item)
            renumbered = [{**g, "params": [index[name] for name in g["params"]]} for g in groups]
            optimizer_states.append({"state": state, "param_groups": renumbered})

    # 1. the archive, with room for every tensor (fake tensors carry shapes only)
    with FakeTensorMode():  # CPU tensors without memory
        skeleton: dict = {"state_dict": {}, "optimizer_states": optimizer_states} if include_optimizer else {}
        for path, item in layout.values():
            _assign(skeleton, path, torch.empty(item.size, dtype=item.properties.dtype))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(dst)
    try:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, tmp)
        del skeleton
        _fill(tmp, src, layout)
        os.replace(tmp, dst)
    finally:
        remove(tmp)  # a failed or interrupted run leaves no partial output
    return dst


def _fill(tmp: Path, src: Path, layout: dict) -> None:
    """2. One tensor at a time: read its shards into a buffer, copy it into ``tmp`` through a shared map."""
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        for key, (path, item) in layout.items():
            buffer = torch.empty(item.size, dtype=item.properties.dtype)
            dcp_load_here({key: buffer}, src)
            mapped = torch.load(tmp, mmap=True, weights_only=True, map_location="cpu")
            _lookup(mapped, path).copy_(buffer)
            del mapped, buffer


def _assign(tree: dict, path: tuple, value) -> None:
    for part in path[:-1]:
        tree = tree[part] if not isinstance(tree, dict) or part in tree else tree.setdefault(part, {})
    tree[path[-1]] = value


def _lookup(tree, path: tuple):
    for part in path:
        tree = tree[part]
    return tree


def iter_model_tensors(src: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of a checkpoint's model ``state_dict``, one tensor in memory at a time (a sharded
    directory), or from a full ``.ckpt`` file."""
    src = Path(src)
    check_complete(src)
    if src.is_file():
        verify_archive(src)
        yield from read_checkpoint_dict(src, mmap=True)["state_dict"].items()
        return
    verify_files(src)
    for key, item in _entries(src, "state_dict."):
        buffer = torch.empty(item.size, dtype=item.properties.dtype)
        dcp_load_here({key: buffer}, src)
        yield key[len("state_dict.") :], buffer


def export_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: str | None = None,
    hf_config: str | os.PathLike | None = None,
    prefix: str | None = None,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write the checkpoint ``src`` as a Hugging Face directory ``dst`` (see ``hf_export.py``). The model's class,
    config and prefix come from the checkpoint (saved by a run whose module holds a ``transformers`` model), or
    from ``hf_config`` (a directory with ``config.json``) and ``prefix``. ``dtype``: ``fp32``/``bf16``/``fp16``."""
    from lightning_zero.checkpoint.hf_export import DTYPES, describe_config_dir, write_hf_dir

    src = Path(src)
    check_complete(src)
    if src.is_dir():
        verify_files(src)
    else:
        verify_archive(src)
    meta = read_checkpoint_dict(src / META_FILE if src.is_dir() else src, mmap=src.is_file())
    record = describe_config_dir(hf_config, prefix or "") if hf_config is not None else meta.get("hf_export")
    if record is None:
        raise CheckpointError(
            f"{src} does not say which Hugging Face model it holds (it was not saved from a module holding a "
            "`transformers` model): pass `--hf-config DIR` (a directory with the model's config.json) and `--prefix`."
        )
    if prefix is not None:
        record = {**record, "prefix": prefix}
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"`dtype={dtype!r}` is not supported; choose one of {tuple(DTYPES)}.")
    return write_hf_dir(
        iter_model_tensors(src), record, dst, dtype=DTYPES[dtype] if dtype else None, max_shard_size=max_shard_size
    )
