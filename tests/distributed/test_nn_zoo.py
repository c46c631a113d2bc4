"""Architectures of ``torch.nn``'s own layers (``nn_zoo.py``: recurrent layers and cells, multi-head attention with
a packed and a split projection, ``nn.TransformerEncoder`` and ``nn.Transformer``, weight, spectral and orthogonal
reparametrizations in both of torch's APIs) at every stage, with activation checkpointing and with the optimizer
offloaded, 2 CPU ranks, fp32, against Lightning ``ddp`` doing the same. ``test_precision_zoo.py`` holds the
reparametrized layers under bf16-mixed in ``make test``."""

import pytest

from tests.distributed.nn_zoo import KINDS
from tests.distributed.worker_zoo import SYSTEMS
from tests.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def zoo():
    return launch("tests.distributed.worker_zoo", "nn", nprocs=2)["nn"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_stage_trains_the_architecture_as_ddp_does(zoo, kind):
    result = zoo[kind]
    assert "error" not in result, result.get("error")
    for system in SYSTEMS["nn"]:
        assert result[system] <= 1e-5, (system, result[system])
