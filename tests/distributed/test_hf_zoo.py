"""Fourteen more Hugging Face architectures (``hf_zoo.py``: mixtures of experts with shared and dropped experts,
state-space and hybrid models, encoder-decoders for text and audio, vision transformers and convnets) at every stage
and with activation checkpointing, 2 CPU ranks, fp32, against Lightning ``ddp`` doing the same. ``make test-all``:
``test_hf_models.py`` holds the exactness against plain PyTorch that ``make test`` runs.

Checkpointed, Switch Transformers ends 4.2e-6 from ``ddp`` (2.4e-7 without): recomputing its blocks reorders
floating-point sums in plain PyTorch too (``gradient_checkpointing_enable()`` against none, one process: 2.7e-6
after the same 3 steps), where every other architecture here is unchanged by checkpointing."""

import pytest

pytest.importorskip("transformers")

from tests.distributed.hf_zoo import KINDS  # noqa: E402
from tests.distributed.worker_zoo import SYSTEMS  # noqa: E402
from tests.launch import launch  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def zoo():
    return launch("tests.distributed.worker_zoo", "hf", nprocs=2)["hf"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_stage_trains_the_architecture_as_ddp_does(zoo, kind):
    result = zoo[kind]
    assert "error" not in result, result.get("error")
    for system in SYSTEMS["hf"]:
        assert result[system] <= 1e-5, (system, result[system])
