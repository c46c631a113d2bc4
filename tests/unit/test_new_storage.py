"""[Note: parameters given new storage] on one process: stages 1-2 follow ``p.data = ...`` as plain PyTorch does."""

import pytest
import torch
from torch import nn

from lightning_zero.engine.mixed_precision import PrecisionPolicy
from lightning_zero.engine.stage12.zero_dp import ZeroDataParallel


def _steps(
    model: nn.Module, engine: ZeroDataParallel | None, optimizer: torch.optim.Optimizer, n: int, mixed: bool
) -> None:
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    for _ in range(n):
        if engine is not None:
            engine.follow_trainability()  # the strategy's on_train_batch_start
            engine.discard_all_gradients()
        with torch.autocast("cpu", torch.bfloat16, enabled=mixed):
            model(x).float().square().mean().backward()
        if engine is None:
            optimizer.step()
        else:
            engine.post_backward()
            engine.optimizer_shards(optimizer).step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("masters", ["none", "host", "bf16"])
def test_a_parameter_given_new_storage_keeps_training(stage, masters):
    """Without masters the optimizer stepped a view of the old storage (the parameter never moved again); a bf16-held
    parameter given an fp32 tensor stayed fp32 (and forward met mixed dtypes). Host masters took the new value in by its
    address already ([Note: parameters written between steps]). Plain PyTorch is the reference (under bf16 autocast
    with bf16 copies, near it)."""
    torch.manual_seed(0)
    model, plain = nn.Linear(4, 4), nn.Linear(4, 4)
    plain.load_state_dict(model.state_dict())
    policy = PrecisionPolicy(torch.bfloat16, torch.float32) if masters == "bf16" else None
    engine = ZeroDataParallel(model, stage=stage, bucket_numel=64, policy=policy, offload_optimizer=masters == "host")
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        engine.wrap_optimizer(optimizer)
        mixed = masters == "bf16"
        _steps(model, engine, optimizer, 2, mixed)
        _steps(plain, None, reference, 2, mixed)
        assigned = torch.full((4, 4), 0.25)
        model.weight.data, plain.weight.data = assigned.clone(), assigned.clone()
        _steps(model, engine, optimizer, 1, mixed)
        _steps(plain, None, reference, 1, mixed)
        assert model.weight.dtype == (torch.bfloat16 if mixed else torch.float32)
        rows = engine.local_rows(0)  # world size 1: every row, as the optimizer steps it
        tolerance = 1e-3 if mixed else 0.0  # the bf16 copies differ from fp32 weights in forward
        torch.testing.assert_close(rows.view(4, 4).float(), plain.weight.detach(), atol=tolerance, rtol=0)
        assert not torch.equal(rows.view(4, 4).float(), assigned)  # it stepped from the assigned value
    finally:
        engine.teardown()


def test_a_parameter_given_another_shape_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4))
    engine = ZeroDataParallel(model, stage=2, bucket_numel=64)
    try:
        engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model[0].weight.data = torch.zeros(2, 4)
        with pytest.raises(
            RuntimeError, match=r"'0.weight' was given a tensor of shape \(2, 4\).*laid out for \(4, 4\)"
        ):
            engine.follow_trainability()
    finally:
        engine.teardown()
