"""Norms and scales over gradients on several devices (lightning_zero/engine/device_groups.py): partial offload keeps
some gradient shards on the host and the rest on the accelerator, and clipping over them failed on a GPU (stacking
norms of two devices; a device coefficient scaling host tensors). A CPU has one device; the meta device stands in
for the second one here, where mixing it with host tensors fails as the accelerator does."""

from __future__ import annotations

import torch

from lightning_zero.engine import device_groups
from lightning_zero.precision.zero_precision import global_grad_norm

META = torch.device("meta")


def test_norms_on_one_device_are_each_tensors_norm_in_order():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0], [2.0, 4.0]]), torch.zeros(3)]
    assert device_groups.norms(tensors, 2.0, torch.device("cpu")).tolist() == [5.0, 5.0, 0.0]
    assert device_groups.norms(tensors, float("inf"), torch.device("cpu")).tolist() == [4.0, 4.0, 0.0]


def test_norms_of_tensors_on_two_devices_meet_on_the_one_asked_for():
    host, other = torch.tensor([3.0, 4.0]), torch.ones(2, device=META)
    values = device_groups.norms([host, other, host], 2.0, META)
    assert values.device == META and values.shape == (3,)
    total = global_grad_norm([host, other], device=META)  # the clipping norm, over both
    assert total.device == META and total.shape == ()
    assert device_groups.by_device([host, other, host]) == {torch.device("cpu"): [0, 2], META: [1]}


def test_a_scale_reaches_the_tensors_of_every_device():
    host, other = torch.tensor([2.0, 4.0]), torch.ones(2, device=META)
    device_groups.scale_([host, other], torch.tensor(0.5))
    assert host.tolist() == [1.0, 2.0]
