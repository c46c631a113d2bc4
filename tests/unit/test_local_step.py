"""Stepping an element-wise optimizer on FSDP2 shards' local tensors (engine/stage3/local_step.py) leaves the
parameters and ``optimizer.state`` exactly as stepping the DTensors does: same values, bit for bit, and state
tensors that are DTensors laid out like their parameters (what checkpoints and ``state_dict`` read)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_zero.engine.optimizers import ELEMENTWISE_OPTIMIZERS
from lightning_zero.engine.stage3.local_step import stepping_local_shards
from lightning_zero.torch_versions.dtensor import dtensor_over
from tests.unit.one_rank import one_rank_world

SETTINGS: dict[str, dict[str, object]] = {
    "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    "Adam": {"lr": 0.01, "amsgrad": True},
    "AdamW": {"lr": 0.01, "weight_decay": 0.1},
    "RAdam": {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1},
    "Rprop": {"lr": 0.01},
}


@pytest.fixture(scope="module")
def mesh():
    with one_rank_world():
        yield init_device_mesh("cpu", (1,))


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


def test_state_stepped_on_host_shards_stays_in_host_memory_under_an_accelerator_mesh(mesh):
    """FSDP2's CPU offload keeps the shards in host memory under a mesh of the accelerator; the state a local-shard
    step creates must stay beside them, as ``zeros_like`` of the DTensor would leave it (``DTensor.from_local``
    would move it to the mesh's device, where the next host step meets it: a run's second step failed so on CUDA).
    Here the mesh names CUDA, which this machine lacks, so any move to the mesh's device fails loudly."""
    accelerator_mesh = DeviceMesh("cuda", [0], _init_backend=False)
    torch.manual_seed(0)
    rows = [torch.randn(3, 2), torch.randn(4)]
    params = [nn.Parameter(dtensor_over(r.clone(), accelerator_mesh, [Shard(0)], r.shape, r.stride())) for r in rows]
    reference = [nn.Parameter(r.clone()) for r in rows]
    opt, ref_opt = torch.optim.Adam(params, lr=0.01), torch.optim.Adam(reference, lr=0.01)
    for step in range(2):
        for p, ref in zip(params, reference):
            ref.grad = torch.full_like(ref, 0.5 + step)
            p.grad = dtensor_over(ref.grad.clone(), accelerator_mesh, [Shard(0)], ref.shape, ref.stride())
        with stepping_local_shards(opt, params):
            opt.step()
        ref_opt.step()
    for p, ref in zip(params, reference):
        assert p.to_local().device.type == "cpu" and torch.equal(p.to_local(), ref.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            held = opt.state[p][key]
            assert isinstance(held, DTensor) and held.device_mesh is accelerator_mesh
            assert held.to_local().device.type == "cpu" and torch.equal(held.to_local(), ref_opt.state[ref][key])
