"""Parameters given new storage between batches (``p.data = ...``), held again as the engine laid them out.

[Note: parameters given new storage]
Some training code replaces a parameter's tensor rather than writing into it: Lightning's ``ModelPruning`` resets
the surviving weights of a lottery ticket with ``weight_orig.data = initial.data`` (its default), and other code
assigns ``p.data`` to load or re-initialise weights. ``ddp`` does not mind: its optimizer holds the ``Parameter``
object. Stages 1-2 keep state tied to the old tensor, so without care the assignment is silently lost or breaks the
collectives:

* in fp32 without masters the optimizer steps views of the parameters' rows; a view of the old storage would take
  every later update while the parameter, never updated again, stays at the assigned value;
* a master copy (mixed precision, offload) would overwrite the assigned value at the next step;
* the value may arrive in another dtype than the one the buckets hold (``ModelPruning``'s copy of the initial
  weights is fp32 where bf16-mixed holds bf16), and a bucket of one dtype would send another dtype's bytes.

So before each batch the engine compares every trainable parameter's address with the one it laid out (one list
comparison when nothing moved) and holds a moved one again: its new value goes into its master at full precision,
it is cast back to its held dtype (and made contiguous), and the optimizer's row views follow it, the same tensor
objects (the optimizer keys its state by them). A parameter whose shape changed cannot be held again and is refused
by name. Writes into a parameter's own storage are the other half, in [Note: parameters written between steps].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_zero.engine.offload import MasterShards
from lightning_zero.engine.shard import local_rows


class StorageWatch:
    """The addresses of the parameters' storage when the engine laid them out or last held them again."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = params
        self.addresses = [p.data_ptr() for p in params]

    def moved(self) -> list[int]:
        """Indices of the parameters given new storage since the last call (the addresses are noted again)."""
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
    """Hold the parameters of ``indices`` again after new storage was assigned to them (see the Note):
    ``row_views(i)`` are the optimizers' views of parameter ``i``'s rows when there are no masters to step."""
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
            else:  # a master that is the rows themselves follows them; a copy was refreshed above
                views = [masters[i]] if i in masters.aliased else []
            for view in views:
                view.data = local_rows(param.detach(), rank, world_size)
