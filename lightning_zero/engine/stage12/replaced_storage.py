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

from lightning_zero.engine.stage12.zero_param import ZeroParam


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
    moved: Iterable[ZeroParam],
    held_dtypes: Sequence[torch.dtype],
    *,
    row_views: Callable[[int], Iterable[torch.Tensor]],
) -> None:
    """See [Note: parameters given new storage]. ``held_dtypes``: each moved parameter's dtype in its bucket;
    ``row_views(i)``: the optimizers' views of parameter ``i``'s rows, where there are no masters."""
    with torch.no_grad():
        for zp, held_dtype in zip(moved, held_dtypes):
            param, shape = zp.param, zp.spec.shape
            if tuple(param.shape) != tuple(shape):
                raise RuntimeError(
                    f"Parameter {zp.name!r} was given a tensor of shape {tuple(param.shape)} during fit, where its "
                    f"shards were laid out for {tuple(shape)}. ZeroStrategy at stages 1-2 follows new values of "
                    "the same shape (`p.data = ...`, `p.copy_(...)`); change a parameter's shape before `fit`."
                )
            if zp.master is not None and not zp.master.aliased:
                zp.master.tensor.copy_(zp.resident_rows())
            if param.dtype != held_dtype or not param.is_contiguous():
                param.data = param.data.to(held_dtype, memory_format=torch.contiguous_format)
            if zp.master is None:
                views = list(row_views(zp.index))
            else:  # a copy was refreshed above
                views = [zp.master.tensor] if zp.master.aliased else []
            for view in views:
                view.data = zp.resident_rows()
