"""Weight averaging at stages 1-2 over the optimizer's rows.

At stages 1-2 every rank holds whole parameters, but the optimizer's truth is this rank's rows of each: fp32 masters
under mixed precision (the module computes with bf16 or fp16 working copies), host copies under offload, views of
the parameters otherwise. Lightning's averaging callbacks deep-copy the whole module, read ``pl_module.parameters()``
and swap the average in and out with ``.data.copy_``: a whole model per rank, and under mixed precision an average of
rounded copies, rounded to the working precision at every validation swap and handed to the masters rounded when
training ends, where ``ddp`` (fp32 parameters under AMP) and stage 3 (fp32 shards) average the fp32 weights.

:class:`OptimizerRows` shows the callbacks those rows instead: a mirror of the module whose trainable parameters are
this rank's rows (sharing their storage) and whose other parameters and buffers are the module's own. The average is
then this rank's rows at the optimizer's precision, a 1/N share of the model, averaged element by element as ``ddp``
averages; after the rows are written (a validation swap, the final copy) the engine gathers the parameters from them
(collective, as after a checkpoint load). In a checkpoint the average's rows are DTensors of the whole shapes, saved
and loaded as stage 3's shards are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_zero.checkpoint.state_dicts import as_sharded
from lightning_zero.engine.api import ShardingEngine
from lightning_zero.engine.shard import local_rows


class OptimizerRows:
    """The module as the optimizer holds it on this rank (see the module docstring)."""

    def __init__(self, module: nn.Module, engine: ShardingEngine) -> None:
        self._module, self._engine = module, engine
        self._view: nn.Module | None = None
        self._rows: tuple[int, ...] = ()
        #: state_dict name -> the whole shape, for the names whose tensor has rows (tied names included)
        self.shapes: dict[str, torch.Size] = {}

    def view(self) -> nn.Module:
        """The mirror over the current rows (built again when the engine replaced them, e.g. on unfreezing)."""
        records = self._engine.records()
        rows = tuple(record.rows.data_ptr() for record in records)
        if self._view is None or rows != self._rows:
            self._view, self._rows = mirror(self._module, {id(r.param): r.rows for r in records}), rows
            by_param = {id(record.param): record for record in records}
            self.shapes = {
                name: by_param[id(tensor)].shape
                for name, tensor in self._module.state_dict(keep_vars=True).items()
                if id(tensor) in by_param
            }
        return self._view

    def view_for(self, average: Iterable[torch.Tensor]) -> nn.Module:
        """:meth:`view`, with ``average`` (an average's tensors in the module's parameter order) brought to its
        layout: a parameter unfrozen since the average began (``BaseFinetuning``) now has rows, and its average,
        whole while it was frozen, becomes this rank's rows of it."""
        view = self.view()
        for kept, current in zip(average, view.parameters()):
            if kept.shape != current.shape:
                kept.data = local_rows(kept.data, self._engine.rank, self._engine.world_size).clone()
        return view

    def copy(self) -> nn.Module:
        """A mirror holding copies of the rows and the module's other tensors: where an average starts."""
        return mirror(self._module, {id(r.param): r.rows.detach().clone() for r in self._engine.records()}, clone=True)

    def wrap(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (rows of the ``state_dict`` entry ``name``) as the DTensor a checkpoint holds."""
        if self._view is None:
            self.view()  # the shapes
        shape = self.shapes.get(name)
        return tensor if shape is None else as_sharded(tensor, shape, self._engine.mesh)

    def written(self) -> None:
        """The rows were written: every rank's parameters follow (collective)."""
        self._engine.params_loaded()


class RowAveragedModel(AveragedModel):
    """``WeightAveraging``'s average of the rows: it updates from them whatever module it is given (the callback
    passes the whole module), and its ``state_dict`` holds the rows as DTensors."""

    def __init__(self, rows: OptimizerRows, **kwargs: Any) -> None:
        super().__init__(rows.copy(), **kwargs)
        self._rows = rows

    def update_parameters(self, model: nn.Module) -> None:
        super().update_parameters(self._rows.view_for(self.module.parameters()))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        state = super().state_dict(*args, **kwargs)
        return {key: self._rows.wrap(key.removeprefix("module."), value) for key, value in state.items()}


def mirror(module: nn.Module, rows: dict[int, torch.Tensor], clone: bool = False) -> nn.Module:
    """Plain modules in ``module``'s hierarchy: a parameter with rows is them, any other parameter and every buffer
    is the module's own (or a copy, with ``clone``), under the same names and in the same order (a tied parameter
    stays one tensor)."""
    params: dict[int, nn.Parameter] = {}
    mirrors: dict[int, nn.Module] = {}
    for name, source in module.named_modules(remove_duplicate=False):
        mirror = mirrors.setdefault(id(source), nn.Module())
        if name:
            parent, _, child = name.rpartition(".")
            mirrors[id(module.get_submodule(parent))].add_module(child, mirror)
        for key, p in source.named_parameters(recurse=False):
            if id(p) not in params:
                if id(p) in rows:
                    params[id(p)] = nn.Parameter(rows[id(p)], requires_grad=False)
                else:
                    params[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=False) if clone else p
            mirror.register_parameter(key, params[id(p)])
        for key, b in source.named_buffers(recurse=False):
            persistent = key not in source._non_persistent_buffers_set
            mirror.register_buffer(key, b.detach().clone() if clone and b is not None else b, persistent=persistent)
    return mirrors[id(module)]
