"""``lightning_zero.fabric.ZeroStrategy`` as ``L.Fabric`` builds it, without processes: the registered names, the
precision it converts, and the settings it refuses before any process starts."""

import inspect

import lightning as L
import pytest

import lightning_zero
from lightning_zero import ZeroConfigError, ZeroPrecision
from lightning_zero.config.zero_config import REGISTERED_STRATEGIES
from lightning_zero.deepspeed_compat.config import CONFIG_DEFAULTS
from lightning_zero.fabric import ZeroStrategy


@pytest.mark.parametrize("name", sorted(n for n, s in REGISTERED_STRATEGIES.items() if s.get("stage") != "auto"))
def test_every_registered_name_builds_the_fabric_strategy(name):
    """Every name but ``zero_auto``, which needs the Trainer (``tests/unit/test_auto.py``)."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=name)
    assert isinstance(fabric.strategy, ZeroStrategy)
    assert fabric.strategy.stage == REGISTERED_STRATEGIES[name].get("stage", 2)
    for setting, value in REGISTERED_STRATEGIES[name].items():
        assert getattr(fabric.strategy.zero_config, setting) == value


def test_fabric_precision_becomes_zero_precision():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="zero3", precision="bf16-mixed")
    assert isinstance(fabric.strategy.precision, ZeroPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"
    plugin = ZeroPrecision("16-mixed", initial_scale=2.0**8)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="zero2", plugins=[plugin])
    assert fabric.strategy.precision is plugin


def test_unsupported_fabric_precision_is_refused():
    with pytest.raises(ZeroConfigError, match="does not support precision '16-true'"):
        L.Fabric(accelerator="cpu", devices=2, strategy="zero2", precision="16-true")


def test_same_settings_as_the_trainer_strategy():
    strategy = ZeroStrategy(
        3, offload_optimizer=0.5, bucket_size_mb=5, activation_checkpointing={"lightning_zero.demo.gpt.Block"}
    )
    trainer_strategy = lightning_zero.ZeroStrategy(
        3, offload_optimizer=0.5, bucket_size_mb=5, activation_checkpointing={"lightning_zero.demo.gpt.Block"}
    )
    assert strategy.zero_config == trainer_strategy.zero_config


def test_deepspeed_config_maps_onto_the_same_settings():
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True}}
    strategy = L.Fabric(accelerator="cpu", devices=2, strategy=ZeroStrategy(config=config)).strategy
    assert strategy.stage == 3 and strategy.zero_config.offload_optimizer
    assert strategy.precision.precision == "bf16-mixed"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"bucket_size": 5}, "unknown setting `bucket_size`. Did you mean 'bucket_size_mb'?"),
        ({"pipeline_stages": 2}, "`pipeline_stages=2` needs the Trainer"),
        ({"sequence_parallel_size": 2}, "`sequence_parallel_size=2` needs the Trainer"),
        ({"config": {"gradient_clipping": 1.0}}, "`gradient_clipping` is applied by the Trainer"),
        ({"config": {"gradient_accumulation_steps": 4}}, "under `fabric.no_backward_sync(model)`"),
        ({"offload_optimizer": 2.0}, "offload_optimizer"),
    ],
)
def test_settings_a_fabric_loop_cannot_take_are_refused_when_built(settings, message):
    with pytest.raises(ZeroConfigError) as error:
        ZeroStrategy(**settings)
    assert message in str(error.value)


def test_signature_shows_the_trainer_strategys_settings_typed():
    """The settings arrive as ``**settings``; ``inspect.signature`` and ``help()`` show them as the Trainer strategy
    declares them, with Fabric's own arguments after."""
    fabric = inspect.signature(ZeroStrategy).parameters
    trainer = inspect.signature(lightning_zero.ZeroStrategy).parameters
    for name in (*CONFIG_DEFAULTS, "config"):
        assert fabric[name] == trainer[name], name
    assert list(fabric)[0] == "stage"
    assert {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision"} <= set(fabric)
