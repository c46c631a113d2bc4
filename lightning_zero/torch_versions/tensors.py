"""Kernels torch exports only privately: packing gradients rank-major, flat copies, the AMP unscale."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["amp_unscale_", "chunk_cat", "flatten_dense_tensors", "unflatten_dense_tensors"]

#: ``torch._chunk_cat(tensors, dim, chunks)``: each tensor split into ``chunks`` along ``dim`` as ``torch.chunk``
#: splits it, each chunk padded to the same length, laid out chunk-major (FSDP2's reduce-scatter input uses it too).
chunk_cat = torch._chunk_cat


def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of ``tensors``, in order (DDP's buckets)."""
    return _flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped like ``tensors``, in order."""
    return tuple(_unflatten_dense_tensors(flat, tensors))


#: ``GradScaler``'s kernel: unscale in place and note a non-finite value in ``found_inf``.
amp_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
