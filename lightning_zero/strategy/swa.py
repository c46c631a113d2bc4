"""Lightning's weight averaging callbacks (``StochasticWeightAveraging``, and ``WeightAveraging`` with its
``EMAWeightAveraging``) under ZeRO.

The callback deep-copies the LightningModule in its ``setup`` hook, before the strategy shards it, and then averages
``zip(average.parameters(), module.parameters())`` element by element. Averaging is element-wise, so it can run on
each rank's rows as well as on whole tensors, and :func:`average_sharded_weights` gives the callback a copy of the
weights as the optimizer holds them on this rank (1/N of the model per rank, not a whole one), which it averages
exactly as ``ddp`` averages:

* stages 1-2: the optimizer's rows (fp32 masters under mixed precision, host copies under offload; ``row_average.py``),
  where the module holds whole parameters, at the working precision under mixed precision;
* stage 3: the module's parameters are FSDP2's sharded DTensors (the callback's whole copy would fail with "got mixed
  torch.Tensor and DTensor"): a mirror of the shards (:class:`ShardedAverage`, :func:`sharded_mirror`), whose
  ``parameters()`` run in the module's order. Under pipeline stages another stage's parameters are on the meta device
  in the mirror, as in the module.

``StochasticWeightAveraging``'s ``state_dict`` holds whole tensors, as ``ddp``'s does: a checkpoint's callback state is
written by rank 0 alone (``meta.pt``). Saving gathers each parameter (and every pipeline stage's), and loading keeps
this rank's rows. ``WeightAveraging``'s checkpoints: ``averaging_checkpoints.py``.

When a callback moves the average into the module (at the end of training), the optimizer's own rows take it too:
host copies (offload) would otherwise hand the module the trained weights back when ``fit`` ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

from lightning_zero.checkpoint.state_dicts import gather_stages
from lightning_zero.engine.api import Holding, ShardingEngine
from lightning_zero.strategy.row_average import OptimizerRows, RowAveragedModel, mirror
from lightning_zero.torch_versions.dtensor import local_rows

try:  # Lightning 2.6
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - older Lightning has StochasticWeightAveraging only
    WeightAveraging = None  # type: ignore[assignment,misc]


class ShardedAverage:
    """What ``StochasticWeightAveraging`` averages into: a detached copy of every parameter as this rank holds it
    (stage 3's shards, the optimizer's rows at stages 1-2, another pipeline stage's on the meta device)."""

    def __init__(
        self,
        module: torch.nn.Module,
        engine: ShardingEngine,
        holding: Holding,
        wrap: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, tensor: tensor,
    ) -> None:
        self._names = [name for name, _ in module.named_parameters()]
        self._params = [p.detach().clone() for p in module.parameters()]
        self._engine, self._holding = engine, holding
        self._wrap = wrap  # the optimizer's rows (``OptimizerRows.wrap``) as the DTensors they are rows of

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self._params)

    def to(self, *args: Any, **kwargs: Any) -> ShardedAverage:
        return self  # each copy already lives where its parameter's shard does

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors; under pipeline stages every stage's, on rank 0, which writes the callback's state
        (collective: every rank saves a checkpoint together)."""
        held = {name: self._wrap(name, p) for name, p in zip(self._names, self._params) if self._holding.holds(name)}
        return gather_stages(held, self._engine, self._names)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, p in zip(self._names, self._params):
            if not self._holding.holds(name):
                continue
            copy_whole_into(self._wrap(name, p), state[name])


def copy_whole_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """``whole`` into ``target``; a DTensor keeps this rank's rows of it, as its parameter's shard does."""
    if isinstance(target, DTensor):
        local = target.to_local()
        local.copy_(rows_of(target, whole).to(local.device, local.dtype))
    else:
        target.copy_(whole)


def rows_of(shard: DTensor, whole: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` that ``shard`` holds on this rank (dim-0 sharding, FSDP2's layout)."""
    return local_rows(whole, shard.device_mesh, shard.placements)


def average_sharded_weights(
    trainer: pl.Trainer,
    module: torch.nn.Module,
    engine: ShardingEngine | None,
    holding: Holding,
    sync_buffers: Callable[[], None],
) -> None:
    """Point every weight averaging callback at the weights as the optimizer holds them on this rank (see the module
    docstring), and make what it moves into the module reach the optimizer's rows. ``sync_buffers``: rank 0's
    buffers to every rank (collective)."""
    if engine is None:
        return
    rows = OptimizerRows(module, engine) if engine.gathered_units is None else None
    for callback in _callbacks(trainer):
        if isinstance(callback, StochasticWeightAveraging):
            _average_for_swa(callback, module, engine, holding, rows)
        elif WeightAveraging is not None and isinstance(callback, WeightAveraging):
            _average_for_weight_averaging(callback, module, engine, rows, sync_buffers)


def _average_for_swa(
    callback: StochasticWeightAveraging,
    module: torch.nn.Module,
    engine: ShardingEngine,
    holding: Holding,
    rows: OptimizerRows | None,
) -> None:
    # The class's own methods, not the instance's, in what replaces them: a second fit must not wrap the first's.
    if (
        rows is not None
    ):  # a stand-in for the callback's copy of the module: it calls only the methods ShardedAverage has
        callback._average_model = ShardedAverage(rows.view(), engine, holding, wrap=rows.wrap)  # type: ignore[assignment]

        def update_from_rows(
            average: Any, pl_module: pl.LightningModule, n_averaged: torch.Tensor, avg_fn: Any
        ) -> None:
            view = rows.view_for(average.parameters())
            StochasticWeightAveraging.update_parameters(average, view, n_averaged, avg_fn)  # type: ignore[arg-type]

        def transfer_to_rows(src_pl_module: pl.LightningModule, dst_pl_module: pl.LightningModule) -> None:
            view = rows.view_for(src_pl_module.parameters())
            StochasticWeightAveraging.transfer_weights(src_pl_module, view)  # type: ignore[arg-type]
            rows.written()

        callback.update_parameters = update_from_rows  # type: ignore[method-assign,assignment]  # this instance's only
        callback.transfer_weights = transfer_to_rows  # type: ignore[method-assign]
        return
    callback._average_model = ShardedAverage(module, engine, holding)  # type: ignore[assignment]

    def transfer_and_follow(src_pl_module: pl.LightningModule, dst_pl_module: pl.LightningModule) -> None:
        StochasticWeightAveraging.transfer_weights(src_pl_module, dst_pl_module)
        engine.params_loaded()  # what derives from the shards (host copies) follows them (collective)

    callback.transfer_weights = transfer_and_follow  # type: ignore[method-assign]  # this instance's only


def _average_for_weight_averaging(
    callback: Any,
    module: torch.nn.Module,
    engine: ShardingEngine,
    rows: OptimizerRows | None,
    sync_buffers: Callable[[], None],
) -> None:
    """The callback swaps the average in when validation starts and out when it ends; each rank averaged its own
    buffers (BatchNorm statistics), and evaluation runs on rank 0's, as ``ddp``'s first forward broadcasts them."""
    kwargs = dict(device=callback._device, use_buffers=callback._use_buffers, **callback._kwargs)
    if rows is not None:
        callback._average_model = RowAveragedModel(rows, **kwargs)

        def swap_with_rows(pl_module: pl.LightningModule) -> None:
            view = rows.view_for(callback._average_model.module.parameters())
            WeightAveraging._swap_models(callback, view)  # type: ignore[arg-type]
            rows.written()
            sync_buffers()

        def copy_to_rows(pl_module: pl.LightningModule) -> None:
            view = rows.view_for(callback._average_model.module.parameters())
            WeightAveraging._copy_average_to_current(callback, view)  # type: ignore[arg-type]
            rows.written()

        callback._swap_models = swap_with_rows  # this instance's only
        callback._copy_average_to_current = copy_to_rows
        return
    callback._average_model = AveragedModel(sharded_mirror(module), **kwargs)

    def swap_and_sync(pl_module: pl.LightningModule) -> None:
        WeightAveraging._swap_models(callback, pl_module)
        sync_buffers()

    callback._swap_models = swap_and_sync  # this instance's only

    def copy_and_follow(pl_module: pl.LightningModule) -> None:
        WeightAveraging._copy_average_to_current(callback, pl_module)
        engine.params_loaded()

    callback._copy_average_to_current = copy_and_follow  # this instance's only


def sharded_mirror(module: torch.nn.Module) -> torch.nn.Module:
    """Plain modules in ``module``'s hierarchy holding detached copies of its parameters (this rank's DTensor shards)
    and buffers under the same names, so that ``parameters()`` and ``buffers()`` run in the same order (a tied
    parameter stays one tensor)."""
    return mirror(module, {}, clone=True)


def clear_schedulers_for_swa(trainer: pl.Trainer | None) -> None:
    """Resuming inside the averaging window: the checkpoint's scheduler state is the callback's ``SWALR``, which it
    rebuilds itself, so the configured schedulers must not take it. The callback clears them in ``on_fit_start``,
    which runs before a ZeroStrategy restores (after ``setup``: the shards must exist first), so that it finds no
    state yet; this does the same once the state is there, before Lightning restores the schedulers."""
    if trainer is None:
        return
    for callback in _callbacks(trainer):
        if isinstance(callback, StochasticWeightAveraging) and callback._scheduler_state is not None:
            callback._clear_schedulers(trainer)


def _callbacks(trainer: pl.Trainer) -> list[Callback]:
    return trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
