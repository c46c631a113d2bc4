"""[Note: functional calls on stage 3 units]: which names ``functional_call`` may replace once a module holds units.
The units here are plain modules registered as this package's engine registers its FSDP2 units (one process)."""

import pytest
import torch
from torch import nn

from lightning_zero.engine.stage3 import fsdp2_functional_calls as calls


@pytest.fixture
def model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    model.temperature = nn.Parameter(torch.tensor(1.0))  # 0-dim: FSDP2 leaves it whole
    model[1].register_parameter("scale", nn.Parameter(torch.tensor(2.0)))
    calls.refuse_functional_calls(nn.Module())  # installs the check; no units of its own
    calls._UNITS.add(model[1])
    yield model
    calls._UNITS.discard(model[1])


def test_a_units_sharded_parameter_is_refused_naming_it_and_the_unit(model):
    x = torch.randn(3, 4)
    with pytest.raises(
        calls.ShardedFunctionalCallError,
        match=r"replace `1.0.weight`, a parameter of the stage-3 unit "
        r"`1` \(Sequential\)",
    ):
        torch.func.functional_call(model, {"1.0.weight": torch.zeros(4, 4)}, (x,))
    with pytest.raises(calls.ShardedFunctionalCallError, match="the module itself"):
        torch.nn.utils.stateless.functional_call(model[1], {"0.bias": torch.zeros(4)}, (x,))


def test_buffers_whole_parameters_and_parameters_outside_units_may_be_replaced(model):
    x = torch.randn(3, 4)
    replaced = {
        "0.weight": torch.zeros(4, 4),
        "0.bias": torch.ones(4),
        "temperature": torch.tensor(3.0),
        "1.scale": torch.tensor(1.0),
        "1.1.running_mean": torch.zeros(4),
    }
    out = torch.func.functional_call(model, replaced, (x,))
    assert out.shape == (3, 4)
    calls._UNITS.discard(model[1])
    assert torch.equal(out, torch.func.functional_call(model, replaced, (x,)))  # no units: the same call
