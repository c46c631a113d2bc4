"""Lightning's ``WeightAveraging`` (``EMAWeightAveraging``) checkpoints under ZeRO, in Lightning's own layout.

The callback writes the average as the checkpoint's ``state_dict`` (what ``load_from_checkpoint`` and inference
want), the trained weights as ``current_model_state`` and its counters as ``averaging_state``; on resume it loads
the average into its ``AveragedModel`` and the trained weights into the module with ``load_state_dict``. Under ZeRO
neither half of that works as written: a sharded directory is loaded into the live shards by the strategy before any
callback runs (its ``state_dict`` is empty by then), a whole-tensor ``load_state_dict`` bypasses the optimizer's fp32
or host rows, and at stage 3 the average is a mirror of DTensor shards (``swa.sharded_mirror``).

So the strategy takes both halves over for each such callback. Saving: a sharded directory holds the trained weights
beside the average, each rank's rows of each (``write.split_checkpoint``; under pipeline stages each stage's); a full
file holds whole tensors, so a stage-3 average is gathered. Loading: a directory is read by
:func:`lightning_zero.checkpoint.io.load` with the average's tensors as a second target (:func:`average_to_load`),
and a full file's halves are copied in here, the trained weights through the strategy's own loader (this rank's
rows). Either way the files are Lightning's: a checkpoint written by ``ddp`` resumes here and a full file written
here resumes under ``ddp``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint.io import AVERAGE_LOADED
from lightning_zero.checkpoint.state_dicts import CURRENT_MODEL_STATE, whole_tensor
from lightning_zero.checkpoint.verify import check_compatible
from lightning_zero.engine.comm import collectives
from lightning_zero.strategy.swa import WeightAveraging, copy_whole_into

AVERAGING_STATE = "averaging_state"  # the callback's key for the AveragedModel's own buffers (``n_averaged``)


def keep_averages_in_checkpoints(
    trainer: pl.Trainer,
    full: Callable[[], bool],
    held: Callable[[dict[str, Any]], dict[str, Any]],
    load_model_state: Callable[[Mapping[str, Any]], None],
) -> None:
    """Take over the checkpoint hooks of every ``WeightAveraging`` callback of ``trainer`` (this instance's only).
    ``full``: whether a save now writes one file from rank 0 (asked at each save: the settings may change between
    saves); ``held``: the entries of a state this rank writes (its pipeline stages'); ``load_model_state``: the
    strategy's ``load_model_state_dict``."""
    if WeightAveraging is None:
        return
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if isinstance(callback, WeightAveraging):
            save = functools.partial(_save, callback, full, held)
            load = functools.partial(_load, callback, load_model_state)
            callback.on_save_checkpoint = save  # type: ignore[method-assign]
            callback.on_load_checkpoint = load  # type: ignore[method-assign]


def average_to_load(trainer: pl.Trainer | None) -> dict[str, torch.Tensor] | None:
    """The tensors a sharded directory's average is read into while a fit restores: the ``AveragedModel``'s module
    state, whose shards (stage 3) and rows (stages 1-2) are DTensors and another pipeline stage's tensors meta; None
    without a ``WeightAveraging`` callback."""
    if WeightAveraging is None or trainer is None:
        return None
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, WeightAveraging) and callback._average_model is not None:
            return _average_tensors(callback._average_model)
    return None


def _average_tensors(average: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The average's module state as its checkpoint entries hold it (``row_average.RowAveragedModel`` gives its
    rows as DTensors)."""
    state = average.state_dict()
    return {key.removeprefix("module."): value for key, value in state.items() if key.startswith("module.")}


def _save(
    callback: Any,
    full: Callable[[], bool],
    held: Callable[[dict[str, Any]], dict[str, Any]],
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    checkpoint: dict[str, Any],
) -> None:
    WeightAveraging.on_save_checkpoint(callback, trainer, pl_module, checkpoint)
    if CURRENT_MODEL_STATE not in checkpoint:
        return
    if full():  # the average's shards (stage 3) or rows (stages 1-2) are DTensors: rank 0 writes them whole
        checkpoint["state_dict"] = _whole_on_rank_zero(checkpoint["state_dict"])
    else:  # each pipeline stage writes its own tensors (another stage's are meta here)
        checkpoint["state_dict"] = held(checkpoint["state_dict"])


def _whole_on_rank_zero(state: dict[str, Any]) -> dict[str, Any]:
    """Collective when ``state`` holds DTensors (the same names in the same order on every rank)."""
    whole = {name: whole_tensor(value) if isinstance(value, DTensor) else value for name, value in state.items()}
    return whole if collectives.rank() == 0 else {}


def _load(
    callback: Any,
    load_model_state: Callable[[Mapping[str, Any]], None],
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    checkpoint: dict[str, Any],
) -> None:
    average = callback._average_model
    if average is None:  # outside a fit: the callback's own warning
        WeightAveraging.on_load_checkpoint(callback, trainer, pl_module, checkpoint)
        return
    averaged = AVERAGING_STATE in checkpoint
    if not checkpoint.get(AVERAGE_LOADED):  # a full file: the module holds its state_dict (the average) now
        _copy_whole_into(_average_tensors(average), checkpoint["state_dict"], strict=averaged)
        if CURRENT_MODEL_STATE in checkpoint:
            load_model_state({"state_dict": checkpoint[CURRENT_MODEL_STATE]})
    if averaged:
        average.load_state_dict(checkpoint[AVERAGING_STATE], strict=False)  # its counters; the weights are in
    else:
        rank_zero_warn(
            "The checkpoint was not created with WeightAveraging. Both the current and the average model "
            "will be initialized with state_dict."
        )


def _copy_whole_into(targets: Mapping[str, torch.Tensor], whole: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Whole tensors into the average: a DTensor keeps this rank's rows; another pipeline stage's (meta) none."""
    check_compatible(
        {k: v.shape for k, v in whole.items()},
        {k: v.shape for k, v in targets.items()},
        "weight average",
        strict=strict,
    )
    with torch.no_grad():
        for name, target in targets.items():
            if name in whole and not target.is_meta:
                copy_whole_into(target, whole[name])
