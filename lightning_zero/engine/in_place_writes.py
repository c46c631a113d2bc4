"""Parameters written in place between steps, where the optimizer's truth is a master copy apart from them.

[Note: parameters written between steps]
Under mixed precision, offload or compressed parameters, the optimizer steps master rows kept apart from the tensors
forward computes with (stages 1-2: the resident parameters; stage 3 with ``offload_optimizer``: the device shards),
and every step copies the masters back over those. Code that writes a parameter in place between steps, as ``ddp``
lets it (a max-norm constraint with ``torch.renorm``, WGAN's weight clipping, SwAV's normalised prototypes, a
``copy_`` from another model), writes only that copy: the next step would overwrite it from the masters, silently
undoing the write. So each copy's version counter (and address) is noted whenever the masters were copied over it,
and before a step reads the masters (or a checkpoint saves them), a copy written since is taken back into its master,
cast from the parameter's dtype (under bf16-mixed the written value is the bf16 one forward computed with).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_zero.engine.offload import MasterShards


class InPlaceWrites:
    """The version marks of the tensors forward computes with, taken when the masters were last copied over them."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[int, int]] = {}

    def mark(self, tensors: Iterable[torch.Tensor]) -> None:
        """The masters were just copied over ``tensors`` (or they were made from them)."""
        for tensor in tensors:
            self._marks[id(tensor)] = (tensor.data_ptr(), tensor._version)

    def written(self, tensor: torch.Tensor) -> bool:
        """Whether something wrote ``tensor`` in place since it was marked."""
        mark = self._marks.get(id(tensor))
        return mark is not None and mark != (tensor.data_ptr(), tensor._version)

    def take_back(
        self,
        masters: MasterShards,
        indices: Iterable[int],
        watched: Callable[[int], torch.Tensor],
        rows: Callable[[int], torch.Tensor],
    ) -> None:
        """Take the rows of each master of ``indices`` whose ``watched`` tensor was written since its mark back into
        it (``rows``: this rank's rows of that tensor)."""
        with torch.no_grad():
            for i in indices:
                if self.written(tensor := watched(i)):
                    masters.refresh_from(i, rows(i))
                    self.mark([tensor])
