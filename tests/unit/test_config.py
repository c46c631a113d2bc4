"""Settings are checked when the strategy is built, before any process group exists."""

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero import ZeroConfigError, ZeroPrecision, ZeroStrategy


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        (dict(stage=4), ["stage=4", "(1, 2, 3, 'auto')", "Did you mean 3?"]),
        (dict(stage="3"), ["stage='3'", "(1, 2, 3, 'auto')", "Did you mean 3 (int, not str)?"]),
        (dict(config=[1, 2]), ["`config`", "a dict or the path of its JSON file", "got list"]),
        (dict(bucket_size_mb=-1), ["bucket_size_mb", "positive"]),
        (dict(bucket_size_mb=0), ["bucket_size_mb", "positive"]),
        (dict(state_dict_type="shraded"), ["state_dict_type", "'sharded'", "Did you mean 'sharded'"]),
        (dict(start_method="thread"), ["start_method", "'spawn'"]),
        (dict(stage=2, offload_params=True), ["offload_params", "stage=3"]),
        (dict(overlap_comm="yes"), ["overlap_comm", "True or False"]),
        (dict(offload_optimizer="cpu"), ["offload_optimizer", "True, False or a share in (0, 1]"]),
        (dict(offload_optimizer=1.5), ["offload_optimizer", "(0, 1]"]),
        (dict(offload_optimizer=0.0), ["offload_optimizer", "(0, 1]"]),
        (dict(stage=3, offload_params=True, pin_memory="yes"), ["pin_memory", "None, True or False"]),
        (dict(offload_optimizer=True, offload_step_delay=2), ["offload_step_delay=2", "(0, 1)"]),
        (dict(optimizer_state_dtype="bfloat16"), ["optimizer_state_dtype='bfloat16'", "('fp32', 'bf16')", "'bf16'"]),
        (dict(optimizer_state_dtype="fp16"), ["optimizer_state_dtype='fp16'", "('fp32', 'bf16')"]),
        (dict(offload_optimizer=True, offload_step_delay=True), ["offload_step_delay='True'", "(0, 1)"]),
        (dict(offload_step_delay=1), ["offload_step_delay=1", "offload_optimizer=True", "got offload_optimizer=False"]),
        (dict(offload_optimizer=0.5, offload_step_delay=1), ["offload_step_delay=1", "offload_optimizer=0.5"]),
        (
            dict(stage=3, offload_optimizer=True, offload_step_delay=1),
            ["offload_step_delay=1", "stage=3", "stage=1 or 2"],
        ),
        (
            dict(stage=2, offload_optimizer=True, offload_step_delay=1, pipeline_stages=2),
            ["offload_step_delay=1", "pipeline_stages=2"],
        ),
    ],
)
def test_bad_settings_name_the_setting_and_the_allowed_values(kwargs, needles):
    with pytest.raises(ZeroConfigError) as err:
        ZeroStrategy(**kwargs)
    for needle in needles:
        assert needle in str(err.value)
    assert not (dist.is_available() and dist.is_initialized())


def test_config_errors_are_value_errors():
    assert issubclass(ZeroConfigError, ValueError)


@pytest.mark.parametrize(("name", "stage"), [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_registered_names_build_the_strategy(name, stage):
    assert name in StrategyRegistry
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.stage == stage
    assert isinstance(trainer.strategy.precision_plugin, ZeroPrecision)


@pytest.mark.parametrize(
    ("name", "stage", "offload_optimizer", "offload_params"),
    [("zero2_offload", 2, True, False), ("zero3_offload", 3, True, True)],
)
def test_offload_names_build_the_strategy(name, stage, offload_optimizer, offload_params):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    config = trainer.strategy.zero_config
    assert (trainer.strategy.stage, config.offload_optimizer, config.offload_params) == (
        stage,
        offload_optimizer,
        offload_params,
    )
    assert config.optimizer_on_host


def test_the_delayed_update_has_a_registered_name():
    trainer = L.Trainer(strategy="zero2_offload_delay", accelerator="cpu", devices=2, logger=False)
    config = trainer.strategy.zero_config
    assert (trainer.strategy.stage, config.offload_optimizer, config.offload_step_delay) == (2, True, 1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_offload_is_accepted_for_every_stage(stage):
    config = ZeroStrategy(stage=stage, offload_optimizer=True).zero_config
    assert config.offload_optimizer and config.optimizer_on_host and config.pin_memory is None


def test_parameter_offload_puts_the_optimizer_on_the_host_too():
    config = ZeroStrategy(stage=3, offload_params=True).zero_config
    assert config.offload_params and config.optimizer_on_host


def test_unknown_registered_name_fails_before_any_process_starts():
    with pytest.raises(ValueError, match="zero4"):
        L.Trainer(strategy="zero4", accelerator="cpu", devices=2)
    assert not (dist.is_available() and dist.is_initialized())


def test_precision_plugin_is_converted_and_unsupported_values_listed():
    trainer = L.Trainer(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=2, precision="32-true", logger=False)
    assert isinstance(trainer.strategy.precision_plugin, ZeroPrecision)
    with pytest.raises(ValueError, match="32-true"):
        ZeroPrecision("64-true")


def test_public_names():
    assert set(lightning_zero.__all__) >= {"ZeroStrategy", "ZeroPrecision", "ZeroConfig"}


def test_selective_updates_resolve_their_defaults():
    """``offload_update_interval=k`` switches selective updates on, with 10% of the columns on the device and a new
    choice every 4 intervals; ``k=1`` is every column every step, and the two others are then refused by name."""
    config = ZeroStrategy(stage=2, offload_optimizer=True, offload_update_interval=4).zero_config
    assert (config.offload_topk_ratio, config.offload_select_interval) == (0.1, 16)
    assert ZeroStrategy(stage=1, offload_optimizer=True).zero_config.offload_update_interval == 1
    with pytest.raises(ZeroConfigError, match="`offload_topk_ratio` applies to selective updates"):
        ZeroStrategy(stage=2, offload_optimizer=True, offload_topk_ratio=0.05)
    with pytest.raises(ZeroConfigError, match="`offload_overlap_step` applies to selective updates"):
        ZeroStrategy(stage=2, offload_optimizer=True, offload_overlap_step=False)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(stage=2, offload_update_interval=4), "lacks: offload_optimizer=True"),
        (dict(stage=2, offload_optimizer=0.5, offload_update_interval=4), "lacks: offload_optimizer=True"),
        (dict(stage=3, offload_optimizer=True, offload_update_interval=4), "lacks: stage=1 or 2"),
        (
            dict(stage=2, offload_optimizer=True, offload_update_interval=4, offload_step_delay=1),
            "offload_step_delay=0",
        ),
        (
            dict(stage=2, offload_optimizer=True, offload_update_interval=4, optimizer_state_dtype="bf16"),
            "optimizer_state_dtype='fp32'",
        ),
        (dict(stage=2, offload_optimizer=True, offload_update_interval=0), "integer >= 1"),
        (
            dict(stage=2, offload_optimizer=True, offload_update_interval=4, offload_topk_ratio=1.0),
            r"share in \(0, 1\)",
        ),
        (dict(stage=2, offload_optimizer=True, offload_update_interval=4, offload_select_interval=6), "multiple of"),
    ],
)
def test_selective_updates_refuse_what_they_cannot_run(settings, message):
    with pytest.raises(ZeroConfigError, match=message):
        ZeroStrategy(**settings)
