"""Stepping an element-wise optimizer on FSDP2 shards' local tensors (engine/stage3/local_step.py) leaves the
parameters and ``optimizer.state`` exactly as stepping the DTensors does: same values, bit for bit, and state
tensors that are DTensors laid out like their parameters (what checkpoints and ``state_dict`` read)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_zero.engine.optimizers import ELEMENTWISE_OPTIMIZERS
from lightning_zero.engine.stage3.local_step import stepping_local_shards

SETTINGS: dict[str, dict[str, object]] = {
    "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    "Adam": {"lr": 0.01, "amsgrad": True},
    "AdamW": {"lr": 0.01, "weight_decay": 0.1},
    "RAdam": {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1},
    "Rprop": {"lr": 0.01},
}


@pytest.fixture(scope="module")
def mesh():
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))


def _train(module: nn.Module, optimizer: torch.optim.Optimizer, local: bool) -> None:
    for step in range(3):
        torch.manual_seed(100 + step)
        module(torch.randn(4, 5)).square().sum().backward()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if local:
            with stepping_local_shards(optimizer, params):
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("name", [cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS])
def test_the_local_step_equals_the_unsharded_step(mesh, name):
    """On one rank a shard is the whole tensor, so the unsharded run is the reference, for every element-wise
    optimizer (Rprop's step does not even run on DTensors: an in-place ``index_put_`` DTensor refuses)."""
    reference, module = _module(), _module()
    fully_shard(module, mesh=mesh)
    ref_opt = getattr(torch.optim, name)(reference.parameters(), **SETTINGS.get(name, {}))
    opt = getattr(torch.optim, name)(module.parameters(), **SETTINGS.get(name, {}))
    _train(reference, ref_opt, local=False)
    _train(module, opt, local=True)
    for expected, got in zip(reference.parameters(), module.parameters()):
        assert isinstance(got, DTensor) and torch.equal(expected, got.full_tensor())
    assert len(opt.state) == len(ref_opt.state)  # nothing keyed by a local tensor is left behind
    for p_ref, p in zip(reference.parameters(), module.parameters()):
        ref_state, state = ref_opt.state[p_ref], opt.state[p]
        assert set(state) == set(ref_state)
        for key, expected in ref_state.items():
            got = state[key]
            if isinstance(expected, torch.Tensor) and expected.shape == p.shape and expected.dim() > 0:
                # what zeros_like(param) makes of a DTensor parameter
                assert isinstance(got, DTensor) and got.placements == p.placements, (name, key)
                got = got.full_tensor()
            else:
                assert not isinstance(got, DTensor), (name, key)
            assert torch.equal(torch.as_tensor(expected), torch.as_tensor(got)), (name, key)
