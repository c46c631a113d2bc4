"""ZeroPrecision settings, the loss-scale schedule, and how Trainer(precision=...) reaches ZeroPrecision."""

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

from lightning_zero import ZeroConfigError, ZeroPrecision, ZeroStrategy
from lightning_zero.precision.loss_scaler import DynamicLossScaler, LossScaleConfig, LossScaleConfigError
from lightning_zero.precision.zero_precision import as_zero_precision as _as_zero_precision


def test_scale_halves_on_overflow_and_grows_after_interval():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale=8.0, growth_interval=2))
    assert [scaler.update(found) for found in (False, False, True, False, False, False)] == [8, 16, 8, 8, 16, 16]
    assert scaler.skipped_steps == 1


def test_hysteresis_and_min_scale():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale=4.0, hysteresis=2, min_scale=2.0))
    assert [scaler.update(True) for _ in range(5)] == [4, 2, 2, 2, 2]
    assert scaler.state_dict() == {"scale": 2.0, "growth_tracker": 0, "hysteresis_left": 1, "skipped_steps": 5}


def test_state_dict_round_trip():
    a = DynamicLossScaler(LossScaleConfig(initial_scale=64.0, growth_interval=3))
    for found in (False, True, False):
        a.update(found)
    b = DynamicLossScaler(LossScaleConfig(initial_scale=64.0, growth_interval=3))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()


def test_deepspeed_fp16_section_maps_onto_the_schedule():
    config = LossScaleConfig.from_deepspeed(
        {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    )
    assert config == LossScaleConfig(initial_scale=4096.0, growth_interval=500, hysteresis=2, min_scale=1.0)
    static = LossScaleConfig.from_deepspeed({"enabled": True, "loss_scale": 128})
    assert static.initial_scale == 128.0 and not static.dynamic
    scaler = DynamicLossScaler(static)
    assert scaler.update(True) == 128.0 and scaler.skipped_steps == 1


def test_deepspeed_unknown_key_is_named():
    with pytest.raises(LossScaleConfigError, match="fp16_opt_level"):
        LossScaleConfig.from_deepspeed({"enabled": True, "fp16_opt_level": "O2"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(precision="16-true"), r"precision='16-true'.*'32-true', 'bf16-mixed', '16-mixed', 'bf16-true'"),
        (dict(precision="bf16-mixed", reduce_dtype="int8"), r"reduce_dtype='int8'.*fp32"),
        (dict(precision="32-true", reduce_dtype="bf16"), r"reduce_dtype.*mixed modes"),
        (dict(precision="bf16-mixed", initial_scale=1024.0), r"16-mixed"),
        (dict(precision="16-mixed", backoff_factor=2.0), r"backoff_factor=2.0.*\(0, 1\)"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, match):
    with pytest.raises(ZeroConfigError, match=match):
        ZeroPrecision(**kwargs)


def test_reduce_dtype_defaults():
    assert ZeroPrecision("16-mixed").reduce_dtype == torch.float32
    assert ZeroPrecision("bf16-mixed").reduce_dtype == torch.bfloat16
    assert ZeroPrecision("bf16-mixed", reduce_dtype="fp32").policy().reduce_dtype == torch.float32
    assert ZeroPrecision("32-true").policy() is None
    assert ZeroPrecision("bf16-true").policy() is None


def test_lightning_plugins_are_converted():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=10)
    converted = _as_zero_precision(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    assert isinstance(converted, ZeroPrecision) and converted.precision == "16-mixed"
    assert converted.loss_scale == 256.0 and converted.scaler.config.growth_interval == 10
    assert _as_zero_precision(HalfPrecision("bf16-true")).precision == "bf16-true"
    with pytest.raises(ZeroConfigError, match="'16-true'.*choose one of"):
        _as_zero_precision(HalfPrecision("16-true"))
    with pytest.raises(ZeroConfigError, match="'64-true'"):
        _as_zero_precision(DoublePrecision())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_precision_selects_zero_precision(precision):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2), precision=precision, logger=False)
    assert isinstance(trainer.precision_plugin, ZeroPrecision)
    assert trainer.precision_plugin.precision == precision


def test_unsupported_trainer_precision_fails_at_construction():
    with pytest.raises(ZeroConfigError, match="choose one of"):
        L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2), precision="16-true", logger=False)


def test_fp16_plugin_passes_through_on_cpu():
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="zero2", plugins=[ZeroPrecision("16-mixed")], logger=False
    )
    assert trainer.precision_plugin.precision == "16-mixed"


def test_the_clipping_norm_counts_the_imaginary_parts_of_complex_gradients():
    """``g.float()`` of a complex gradient drops its imaginary part: the norm of (3+4j, 12) came out 12.37, not 13, so
    a Fourier layer's gradients were clipped by the wrong coefficient at every stage."""
    from lightning_zero.precision.zero_precision import global_grad_norm

    grads = [torch.tensor([3 + 4j, 0j]), torch.tensor([12.0], dtype=torch.bfloat16)]
    assert global_grad_norm(grads, torch.device("cpu")).item() == 13.0
