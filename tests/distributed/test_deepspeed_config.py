"""A DeepSpeed JSON config driving a real fit in one process; the mapping itself is tested in
tests/unit/test_deepspeed_config.py, before any process starts."""

import pytest

from tests.launch import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fits():
    return launch("tests.distributed.worker_deepspeed_config", "fit", nprocs=1)["fit"]


def test_trainer_level_settings_apply_in_a_real_fit(fits):
    """Clipping, accumulation, optimizer, scheduler and precision come from the JSON."""
    assert fits["micro_batch_4"] == {
        "clip": 1.0,
        "accumulate": 2,
        "optimizer": "AdamW",
        "betas": [0.9, 0.95],
        "weight_decay": 0.01,
        "lr": pytest.approx(0.00015 * 3 / 4),
        "scheduler": "DeepSpeedWarmupLR",
        "precision": "16-mixed",
        "offload": True,
        "steps": 3,
    }


def test_a_dataloader_that_contradicts_the_micro_batch_is_an_error_naming_both(fits):
    error = fits["batch_2"]["error"]
    assert "train_micro_batch_size_per_gpu=4" in error and "batch_size is 2" in error
