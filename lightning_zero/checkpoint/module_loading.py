"""A trained LightningModule back in one plain process, from any ZeroStrategy checkpoint.

``MyModule.load_from_checkpoint(path)`` cannot read a sharded checkpoint: Lightning opens ``path`` as one file
(``pl_load``), and a sharded checkpoint is a directory, so it fails with ``IsADirectoryError``; making it read
directories would mean patching Lightning. :func:`load_from_checkpoint` is the one-line way instead. It takes the
module class and the checkpoint (a sharded directory of any stage and world size, or a full file). It builds the
checkpoint dict Lightning's own ``load_from_checkpoint`` would have read: ``meta.pt``'s hyperparameters and the
full ``state_dict`` put together from the shards, one tensor at a time. Then it hands that dict to Lightning's
loader (``lightning.pytorch.core.saving._load_state``), so the result is what ``load_from_checkpoint`` gives:
hyperparameters restored and overridable by keyword, ``configure_model`` and ``on_load_checkpoint`` called,
``strict`` honoured. Everything is read with ``weights_only=True``, and the file checksums are verified first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.saving import _load_state
from torch.distributed.fsdp import FSDPModule

from lightning_zero.checkpoint.consolidate import iter_model_tensors
from lightning_zero.checkpoint.verify import META_FILE, check_complete, read_checkpoint_dict

ModuleT = TypeVar("ModuleT", bound=pl.LightningModule)


def load_from_checkpoint(
    module_class: type[ModuleT],
    path: str | os.PathLike,
    *,
    map_location: str | torch.device | None = None,
    strict: bool | None = None,
    **hparams: Any,
) -> ModuleT:
    """``module_class`` with the weights and hyperparameters of the checkpoint at ``path`` (``hparams`` override
    saved ones, as in ``load_from_checkpoint``), on ``map_location`` (default: the CPU)."""
    module_class = _unsharded_class(module_class)
    path = Path(path)
    check_complete(path)
    checkpoint = read_checkpoint_dict(path if path.is_file() else path / META_FILE)
    checkpoint["state_dict"] = dict(iter_model_tensors(path))
    checkpoint.setdefault(module_class.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(hparams)
    module = _load_state(module_class, checkpoint, strict=strict, **hparams)
    if not isinstance(module, module_class):
        raise RuntimeError("lightning_zero internal error: Lightning's _load_state returns a ``module_class(...)``")
    return module.to(map_location or "cpu")


def _unsharded_class(module_class: type[ModuleT]) -> type[ModuleT]:
    """The user's class behind ``type(model)`` of a module a stage-3 ``fit`` sharded: FSDP2 gives it a class of its
    own (``FSDPMyModule``) whose constructor builds a plain ``MyModule``."""
    if issubclass(module_class, FSDPModule):
        mro = module_class.__mro__
        return next(c for c in mro if issubclass(c, pl.LightningModule) and not issubclass(c, FSDPModule))
    return module_class
