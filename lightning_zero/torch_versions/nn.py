"""torch.nn's private base class of the normalisation layers that keep running statistics."""

from __future__ import annotations

from torch.nn.modules.batchnorm import _NormBase

__all__ = ["NormBase"]

#: Every BatchNorm and InstanceNorm layer (``running_mean``, ``running_var``, ``num_batches_tracked``); torch has no
#: public name for the family.
NormBase = _NormBase
