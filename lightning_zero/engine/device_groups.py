"""Norms and scales over gradients held on several devices.

Partial offload (``offload_optimizer`` a fraction) keeps some gradient shards in host memory and the rest on the
accelerator. torch's foreach kernels fall back to one kernel per tensor over such a list, but the norms they
return lie on their tensors' devices, so stacking them fails, and a 0-dim coefficient on the accelerator cannot
scale a host tensor. On a CPU every tensor is on one device and nothing of this shows. So a norm or a scale over
gradients runs once per device here, and the results meet on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    """Positions in ``tensors`` by the device each lies on, in order."""
    groups: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(tensor.device, []).append(i)
    return groups


def norms(tensors: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Each tensor's ``norm_type``-norm, in order, as one float64 vector on ``device``: a foreach kernel per device."""
    groups = by_device(tensors)
    if len(groups) == 1:
        return torch.stack(torch._foreach_norm(list(tensors), norm_type)).double().to(device)
    out = torch.empty(len(tensors), dtype=torch.float64, device=device)
    for index in groups.values():
        values = torch.stack(torch._foreach_norm([tensors[i] for i in index], norm_type)).double()
        out[torch.tensor(index, device=device)] = values.to(device)
    return out


def scale_(tensors: Sequence[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply ``tensors`` in place by the 0-dim ``coefficient``, copied to each of their devices once."""
    for where, index in by_device(tensors).items():
        torch._foreach_mul_([tensors[i] for i in index], coefficient.to(where))
