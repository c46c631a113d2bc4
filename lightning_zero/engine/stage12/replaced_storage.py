"""Parameters given new storage between batches (``p.data = ...``), held again as the engine laid them out.

[Note: parameters given new storage]
Some training code replaces a parameter's tensor rather than writing into it: Lightning's ``ModelPruning`` resets the
surviving weights of a lottery ticket with ``weight_orig.data = initial.data``. ``ddp`` does not mind, since its
optimizer holds the ``Parameter`` object, but stages 1-2 keep state tied to the old tensor:

* without masters the optimizer steps views of the parameters' rows; a view of the old storage would take every later
  update while the parameter stays at the assigned value;
* a master copy (mixed precision, offload) would overwrite the assigned value at the next step;
* the value may arrive in another dtype than its bucket holds (``ModelPruning``'s fp32 copy under bf16-mixed), and the
  bucket would send another dtype's bytes.

So before each batch the engine compares every trainable parameter's address with the one it laid out, and holds a moved
one again: its new value goes into its master at full precision, it is cast back to its held dtype, and the optimizer's
row views follow it, the same tensor objects, since the optimizer keys its state by them. Writes into a parameter's own
storage are the other half, in [Note: parameters written between steps].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_zero.engine.offload.masters import MasterShards
from lightning_zero.engine.shard import local_rows


class StorageWatch:
    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = params
        self.addresses = [p.data_ptr() for p in params]

    def moved(self) -> list[int]:
        addresses = [p.data_ptr() for p in self.params]
        if addresses == self.addresses:
            return []
        moved = [i for i, (now, then) in enumerate(zip(addresses, self.addresses)) if now != then]
        self.addresses = addresses
        return moved


def hold_again(
    indices: Iterable[int],
    params: Sequence[nn.Parameter],
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    held_dtypes: Sequence[torch.dtype],
    *,
    rank: int,
    world_size: int,
    masters: MasterShards | None,
    row_views: Callable[[int], Iterable[torch.Tensor]],
) -> None:
    """See [Note: parameters given new storage]. ``row_views(i)``: the optimizers' views of parameter ``i``'s rows,
    where there are no masters."""
    with torch.no_grad():
        for i in indices:
            param = params[i]
            if tuple(param.shape) != tuple(shapes[i]):
                raise RuntimeError(
                    f"Parameter {names[i]!r} was given a tensor of shape {tuple(param.shape)} during fit, where its "
                    f"shards were laid out for {tuple(shapes[i])}. ZeroStrategy at stages 1-2 follows new values of "
                    "the same shape (`p.data = ...`, `p.copy_(...)`); change a parameter's shape before `fit`."
                )
            if masters is not None and i not in masters.aliased:
                masters.refresh_from(i, local_rows(param.detach(), rank, world_size))
            if param.dtype != held_dtypes[i] or not param.is_contiguous():
                param.data = param.data.to(held_dtypes[i], memory_format=torch.contiguous_format)
            if masters is None:
                views = list(row_views(i))
            else:  # a copy was refreshed above
                views = [masters[i]] if i in masters.aliased else []
            for view in views:
                view.data = local_rows(param.detach(), rank, world_size)
