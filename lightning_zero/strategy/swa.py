"""Lightning's ``StochasticWeightAveraging`` under ZeRO-3.

The callback deep-copies the LightningModule in its ``setup`` hook, before the strategy shards it, and then averages
``zip(average.parameters(), module.parameters())`` element by element. At stage 3 the module's parameters are
FSDP2's sharded DTensors while the copy holds whole tensors (or, for a module built in ``configure_model``, none),
so ``copy_`` fails with "got mixed torch.Tensor and DTensor". Averaging is element-wise, so it can run on each rank's
shard as well as on the whole tensor: :func:`average_sharded_weights` gives the callback a copy of the sharded
parameters (1/N of the weights per rank, not a whole model) and it averages exactly what ``ddp`` averages.

Its ``state_dict`` holds whole tensors, as ``ddp``'s does: a checkpoint's callback state is written by rank 0 alone
(``meta.pt``). Saving gathers each parameter, and loading keeps this rank's rows. After the callback moves the
average into the module, the engine refreshes whatever it keeps beside the parameters (host master copies).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch.distributed.tensor import DTensor

from lightning_zero.engine.api import ShardingEngine


class ShardedAverage:
    """What the callback averages into at stage 3: a detached copy of every parameter as this rank holds it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._names = [name for name, _ in module.named_parameters()]
        self._params = [p.detach().clone() for p in module.parameters()]

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self._params)

    def to(self, *args: Any, **kwargs: Any) -> ShardedAverage:
        return self  # each copy already lives where its parameter's shard does

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors (collective: every rank saves a checkpoint together)."""
        return {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in zip(self._names, self._params)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, p in zip(self._names, self._params):
            whole = state[name]
            if isinstance(p, DTensor):  # keep this rank's rows of the whole tensor, as its parameter's shard does
                local = p.to_local()
                rows = _rows_of(p, whole)
                local.copy_(rows.to(local.device, local.dtype))
            else:
                p.copy_(whole)


def _rows_of(shard: DTensor, whole: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` that ``shard`` holds on this rank (dim-0 sharding, FSDP2's layout)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(whole.shape, shard.device_mesh, shard.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return whole[index]


def average_sharded_weights(trainer: pl.Trainer, module: torch.nn.Module, engine: ShardingEngine | None) -> None:
    """Point every ``StochasticWeightAveraging`` callback at the sharded parameters when the engine shards the
    module in place (stage 3); stages 1-2 keep whole parameters and the callback's own copy works there."""
    if engine is None or not engine.shards_module_in_place:
        return
    refresh = engine.params_loaded
    for callback in _callbacks(trainer):
        if isinstance(callback, StochasticWeightAveraging):
            # A stand-in for the callback's copy of the module: it calls only the methods ShardedAverage has.
            callback._average_model = ShardedAverage(module)  # type: ignore[assignment]

            def transfer_and_refresh(src_pl_module: pl.LightningModule, dst_pl_module: pl.LightningModule) -> None:
                # The class's own method, not the instance's: a second fit must not wrap the first fit's wrapper.
                StochasticWeightAveraging.transfer_weights(src_pl_module, dst_pl_module)
                refresh()  # e.g. host masters of the parameters now hold the average too

            callback.transfer_weights = transfer_and_refresh  # type: ignore[method-assign]  # this instance's only


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
