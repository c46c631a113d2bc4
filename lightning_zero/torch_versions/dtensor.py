"""DTensor's private pieces: a DTensor over a local tensor left where it is, and a rank's rows of a global tensor.

[Note: DTensors over host shards]
``DTensor.from_local`` moves its local tensor to the device type of the mesh. Under FSDP2's CPU offload
(``offload_params``) and our host masters, shards live in host memory under a mesh of the accelerator: the mesh
names where the collectives run, not where the rows are stored. Wrapping such a shard with ``from_local`` copies
it to the accelerator, so optimizer state stepped on the host would come back on the device (and the next host
step would meet it there), and a checkpoint staged in host memory would be copied back to the device it was meant
to leave. FSDP2 builds its own sharded parameters without the move (``_from_local_no_grad``); so does this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement


def dtensor_over(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int], stride: Sequence[int]
) -> DTensor:
    """``local`` as this rank's part of a DTensor of global ``shape`` and ``stride``, without copying or moving it
    (see [Note: DTensors over host shards]); like ``from_local(..., run_check=False)`` otherwise."""
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=local.requires_grad)


def local_rows(whole: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """The part of ``whole`` that this rank holds of a DTensor of ``whole``'s shape on ``mesh`` with ``placements``
    (DTensor's own arithmetic, as ``distribute_tensor`` would cut it)."""
    shape, offset = compute_local_shape_and_global_offset(whole.shape, mesh, placements)
    return whole[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
