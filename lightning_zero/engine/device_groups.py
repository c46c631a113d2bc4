"""Norms and scales over gradients held on several devices.

Partial offload keeps some gradient shards in host memory and the rest on the accelerator. The norms torch's foreach
kernels return over such a list lie on their tensors' devices, so stacking them fails, and a 0-dim coefficient on the
accelerator cannot scale a host tensor. So a norm or a scale over gradients runs once per device here, and the results
meet on one device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(tensor.device, []).append(i)
    return groups


def norms(
    tensors: Sequence[torch.Tensor],
    norm_type: float,
    device: torch.device,
    known: Mapping[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One float64 vector on ``device``: a foreach kernel per device; ``known``: ``id(tensor)`` -> its norm taken
    already by the same kernel (the same value it would give here), for those it need not read again."""
    if known:
        taken = [i for i, tensor in enumerate(tensors) if id(tensor) in known]
        if taken:
            rest = [i for i, tensor in enumerate(tensors) if id(tensor) not in known]
            out = torch.empty(len(tensors), dtype=torch.float64, device=device)
            values = torch.stack([known[id(tensors[i])] for i in taken]).double()
            out[torch.tensor(taken, device=device)] = values.to(device)
            if rest:
                out[torch.tensor(rest, device=device)] = norms([tensors[i] for i in rest], norm_type, device)
            return out
    groups = by_device(tensors)
    if len(groups) == 1:
        return torch.stack(torch._foreach_norm(list(tensors), norm_type)).double().to(device)
    out = torch.empty(len(tensors), dtype=torch.float64, device=device)
    for index in groups.values():
        values = torch.stack(torch._foreach_norm([tensors[i] for i in index], norm_type)).double()
        out[torch.tensor(index, device=device)] = values.to(device)
    return out


def scale_(tensors: Sequence[torch.Tensor], coefficient: torch.Tensor) -> None:
    for where, index in by_device(tensors).items():
        torch._foreach_mul_([tensors[i] for i in index], coefficient.to(where))
