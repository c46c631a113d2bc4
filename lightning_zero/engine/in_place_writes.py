"""Parameters written in place between steps, where the optimizer's truth is a master copy apart from them.

[Note: parameters written between steps]
Under mixed precision, offload or compressed parameters, the optimizer steps master rows kept apart from the tensors
forward computes with, and every step copies the masters back over those. Code that writes a parameter in place between
steps, as ``ddp`` lets it (a max-norm constraint, WGAN's weight clipping, a ``copy_`` from another model), writes only
that copy, and the next step would silently overwrite it from the masters. So each copy's version counter and address
are noted whenever the masters were copied over it, and before a step reads the masters (or a checkpoint saves them), a
copy written since is taken back into its master.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_zero.engine.offload.masters import MasterShards


class InPlaceWrites:
    def __init__(self) -> None:
        self._marks: dict[int, tuple[int, int]] = {}

    def mark(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._marks[id(tensor)] = (tensor.data_ptr(), tensor._version)

    def written(self, tensor: torch.Tensor) -> bool:
        mark = self._marks.get(id(tensor))
        return mark is not None and mark != (tensor.data_ptr(), tensor._version)

    def take_back(
        self,
        masters: MasterShards,
        indices: Iterable[int],
        watched: Callable[[int], torch.Tensor],
        rows: Callable[[int], torch.Tensor],
    ) -> None:
        with torch.no_grad():
            for i in indices:
                if self.written(tensor := watched(i)):
                    masters.refresh_from(i, rows(i))
                    self.mark([tensor])
