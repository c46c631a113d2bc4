"""FSDP2's private names that the stage-3 engine uses (lightning_zero/engine/stage3/fsdp2_private.py), checked on the
installed torch with a real ``fully_shard`` module on a 1-rank gloo group in this process: a torch release that
moves one fails here with the name, before any training test does."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_zero.engine.stage3 import fsdp2_private
from tests.unit.one_rank import one_rank_world


@pytest.fixture
def sharded():
    """A two-unit module sharded with FSDP2 over one rank (the process group is this test's own)."""
    with one_rank_world():
        mesh = init_device_mesh("cpu", (1,))
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(module[0], mesh=mesh)
        fully_shard(module, mesh=mesh)
        yield module


def test_every_private_name_is_where_the_engine_expects_it(sharded):
    fsdp2_private.check(sharded)
    groups = fsdp2_private.param_groups(sharded)
    assert len(groups) == 2  # the inner unit's and the root's
    params = list(fsdp2_private.sharded_params(sharded[0]))
    assert [p.shape for p, _ in params] == [torch.Size([4, 4]), torch.Size([4])]
    assert not any(offloaded for _, offloaded in params)


def test_modules_of_one_fully_shard_call_share_one_group():
    """Merged units (fsdp2.py's [Note: merged units]): each module of ``fully_shard([a, b])`` is an FSDPModule, and
    their one parameter group is counted once."""
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard([module[0], module[1]], mesh=mesh)
        fully_shard(module, mesh=mesh)
        assert len(fsdp2_private.param_groups(module)) == 2  # the merged pair's and the root's
        assert fsdp2_private.unit_heads(module) == [module, module[0]]  # one module per call, first in module order
        assert len(list(fsdp2_private.sharded_params(module[1]))) == 4  # both Linears' weights and biases
    finally:
        dist.destroy_process_group()


def test_a_merged_unit_listed_once_per_module_is_reduced_once_a_backward():
    """[Note: a merged unit's post-backward called again]: torch 2.11 lists a ``fully_shard([a, b])`` call's state once
    per module, and its final callback ran the unit's post-backward again after the unit was reduced, each time
    zero-filling and reducing every parameter. The state is listed twice here as torch 2.11 lists it; the unit is
    still completed and reduced once a backward, with the gradients of one reduction."""
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard([module[0], module[1]], mesh=mesh)
        fully_shard(module, mesh=mesh)
        merged = fsdp2_private.own_groups(module[0])[0]
        completed: list[Any] = []
        for group in fsdp2_private.param_groups(module):
            fsdp2_private.watch_post_backward(group, lambda g: completed.append(g) if g is merged else None)
        x = torch.randn(3, 4)
        module(x).square().sum().backward()  # FSDP2's lazy initialisation built the state list
        first = [p.grad.full_tensor().clone() for p in module[0].parameters()]
        state = module[0]._get_fsdp_state()
        state._state_ctx.all_states.append(state)  # as torch 2.11 lists it: once per module of the call
        for p in module.parameters():
            p.grad = None
        completed.clear()
        module(x).square().sum().backward()
        assert completed == [merged]
        assert all(torch.equal(p.grad.full_tensor(), g) for p, g in zip(module[0].parameters(), first))
    finally:
        dist.destroy_process_group()


def test_a_window_keeps_and_restores_each_setting(sharded):
    group = fsdp2_private.param_groups(sharded)[0]
    before = group.post_forward_mesh_info
    setting = fsdp2_private.keep_gathered_after_forward(group)
    assert group.post_forward_mesh_info is None
    fsdp2_private.restore_after_forward(group, setting)
    assert group.post_forward_mesh_info is before
    own = group.reshard
    previous = fsdp2_private.reshard_only_after_backward(group)
    assert previous == own and group.reshard != own  # the instance's shadow
    fsdp2_private.unshadow_reshard(group, previous)
    assert group.reshard == own


def test_gathers_and_reshards_are_watched_once_each_and_only_when_they_happen(sharded):
    """``watch_gathering``: told after a gather lands (not after a no-op on a unit gathered already), and before a
    reshard that frees the copies (not one of a unit already sharded); watched again (a second engine on the same
    module), FSDP2's own methods are wrapped, not the earlier wrappers."""
    group = fsdp2_private.param_groups(sharded)[0]
    told: list[str] = []
    fsdp2_private.watch_gathering(group, lambda g: told.append("stale"), lambda g: told.append("stale"))
    fsdp2_private.watch_gathering(group, lambda g: told.append("gathered"), lambda g: told.append("resharding"))
    sharded.unshard()
    sharded.unshard()
    sharded.reshard()
    sharded.reshard()
    assert told == ["gathered", "resharding"]


def test_a_parameter_written_while_gathered_reaches_its_shard_when_the_unit_reshards(sharded):
    """[Note: writes into gathered parameters]: an EMA codebook kept as a frozen parameter and written inside
    ``training_step`` wrote the gathered copy, which resharding freed (a VQ-VAE at stage 3 ended 1e5 from ``ddp``)."""
    from lightning_zero.engine.stage3.fsdp2_window import GatheredWrites

    GatheredWrites(fsdp2_private.param_groups(sharded))
    unit = sharded[0]
    weight = fsdp2_private.param_groups(unit)[0].fsdp_params[0]
    unit.unshard()
    with torch.no_grad():
        weight._unsharded_param.mul_(0.0).add_(0.5)
    unit.reshard()
    assert bool((unit.weight.to_local() == 0.5).all())
    unit.unshard()  # gathered again: nothing written since, nothing copied
    version = weight.sharded_param._version
    unit.reshard()
    assert weight.sharded_param._version == version


def test_a_write_to_a_gathered_parameter_is_copied_into_its_shard(sharded):
    """What a unit does before it reshards ([Note: writes into gathered parameters]): only the parameters
    written since the versions were noted go back, through the sharded parameter (whose own version then counts it)."""
    sharded.unshard()
    group = fsdp2_private.param_groups(sharded)[0]
    marks = fsdp2_private.gathered_versions(group)
    weight, bias = (fsdp_param._unsharded_param for fsdp_param in group.fsdp_params)
    with torch.no_grad():
        weight.fill_(0.25)
    shards = [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]
    bias_before, versions = shards[1].to_local().clone(), [p._version for p in shards]
    fsdp2_private.write_back_gathered(group, marks)
    assert bool((shards[0].to_local() == 0.25).all())
    assert torch.equal(shards[1].to_local(), bias_before) and shards[1]._version == versions[1]
    assert shards[0]._version > versions[0]
    sharded.reshard()


@pytest.mark.parametrize(
    "owner, attribute", [("FSDPParamGroup", "post_forward_mesh_info"), ("FSDPParam", "sharded_param")]
)
def test_a_moved_name_fails_naming_it(sharded, owner, attribute):
    group = fsdp2_private.param_groups(sharded)[0]
    holder = group if owner == "FSDPParamGroup" else group.fsdp_params[0]
    delattr(holder, attribute)  # as a torch release that renamed it
    with pytest.raises(
        fsdp2_private.FSDP2PrivateAPIError, match=rf"FSDP2's {owner}\.{attribute} is gone; .*fsdp2_private\.py"
    ):
        fsdp2_private.check(sharded)


def test_a_conversion_that_changes_nothing_leaves_a_gathered_unit_gathered_and_a_real_one_still_converts(sharded):
    """A router casting itself to fp32 in forward (Hugging Face's Switch Transformers) calls ``.to()`` on a gathered
    unit every step: FSDP2's ``_apply`` resharded it for that, and failed on a unit kept gathered through an
    accumulation window (``'Parameter' object has no attribute '_local_tensor'``)."""
    unit = sharded[0]
    fsdp2_private.skip_conversions_that_change_nothing([unit])
    group = fsdp2_private.param_groups(unit)[0]
    setting = fsdp2_private.keep_gathered_after_forward(group)
    unit.unshard()
    gathered = unit.weight
    assert unit.to(torch.float32) is unit and unit.float() is unit
    assert unit.weight is gathered and group.is_unsharded  # nothing resharded, nothing re-registered
    fsdp2_private.restore_after_forward(group, setting)
    unit.reshard()
    unit.to(torch.float64)  # a conversion that changes something takes FSDP2's own path
    assert unit.weight.dtype == torch.float64 and unit.weight.to_local().dtype == torch.float64


def test_the_dtype_a_parameter_is_gathered_in_is_known_after_the_first_forward(sharded):
    """``gathered_dtype`` reads ``FSDPParam.param_dtype``, which FSDP2 sets at its lazy initialisation (so ``check``
    cannot look for it at set-up): a torch that renames it fails here."""
    sharded(torch.randn(2, 4)).sum().backward()
    fsdp_param = fsdp2_private.param_groups(sharded[0])[0].fsdp_params[0]
    assert fsdp2_private.gathered_dtype(fsdp_param) == torch.float32


def test_a_sharded_weight_normed_model_is_freed_once_nothing_refers_to_it():
    """``fully_shard`` caches the subclass it makes of each class; a parametrized layer's class is made for that one
    instance and its ``weight`` property closes over it, so the cache kept the model and its shards alive after
    ``fit`` (a process that trained Wav2Vec2 at stage 3 held every model it built). The engine drops those entries."""
    import gc
    import weakref

    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        module = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3)), nn.Linear(4, 2))
        fully_shard(module[0], mesh=mesh)
        fsdp2_private.forget_classes_of_one_module()
        fully_shard(module, mesh=mesh)
        fsdp2_private.forget_classes_of_one_module()
        layer = weakref.ref(module[0])
        assert type(module[0]).__name__ == "FSDPParametrizedConv1d"  # the instance keeps its class
        del module
        gc.collect()
        assert layer() is None
    finally:
        dist.destroy_process_group()


def test_a_complex_parameter_is_gathered_complex_under_a_bf16_policy_and_a_real_one_in_bf16():
    """[Note: complex parameters under FSDP2's mixed precision]: torch 2.11's FSDP2 would gather the complex
    weight in bf16, its imaginary part lost; every torch gathers it complex once the engine has been through."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    class Weights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(torch.full((4,), 1 + 2j, dtype=torch.complex64))

        def forward(self, x):
            return x.to(torch.complex64) * self.weights

    class Spectral(nn.Module):  # FSDP2 gathers one dtype per unit: the complex weights are a unit of their own
        def __init__(self) -> None:
            super().__init__()
            self.spectral = Weights()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x), self.spectral(x)

    with one_rank_world():
        module, mesh = Spectral(), init_device_mesh("cpu", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for unit in (
            fully_shard(module.spectral, mesh=mesh, mp_policy=policy),
            fully_shard(module, mesh=mesh, mp_policy=policy),
        ):
            fsdp2_private.keep_complex_params_complex(unit)
        real, spectral = module(torch.ones(2, 4))
        gathered = {
            p._param_fqn: p.param_dtype for group in fsdp2_private.param_groups(module) for p in group.fsdp_params
        }
        assert gathered == {"spectral.weights": None, "linear.weight": torch.bfloat16, "linear.bias": torch.bfloat16}
        assert real.dtype == torch.bfloat16 and spectral.dtype == torch.complex64
        assert torch.equal(spectral, torch.full((2, 4), 1 + 2j, dtype=torch.complex64))
