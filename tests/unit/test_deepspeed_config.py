"""DeepSpeed-style JSON configs: mapping, unsupported and conflicting keys, all before any process starts.

``tests/data/ds_zero2_offload_fp16.json`` follows DeepSpeed's ZeRO-Offload tutorial and the Megatron GPT-2
example configs of DeepSpeedExamples: ZeRO-2, optimizer offload to pinned CPU memory, fp16 with dynamic loss
scaling, Adam, WarmupLR, clipping 1.0, two accumulation steps.
"""

import json
import multiprocessing
from pathlib import Path

import lightning as L
import pytest
import torch.distributed as dist

from lightning_zero import ZeroConfigError, ZeroPrecision, ZeroStrategy
from lightning_zero.deepspeed_compat.config import parse_deepspeed_config
from lightning_zero.deepspeed_compat.trainer import DeepSpeedWarmupLR
from tests.distributed import models

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "tests" / "data" / "ds_zero2_offload_fp16.json"


def _trainer(strategy, **kwargs):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, **kwargs)


def test_real_example_maps_onto_the_same_strategy_and_precision_as_explicit_arguments():
    from_json = _trainer(ZeroStrategy(config=str(EXAMPLE)))
    explicit = _trainer(
        ZeroStrategy(stage=2, offload_optimizer=True, pin_memory=True, bucket_size_mb=2e8 * 4 / 2**20),
        plugins=[ZeroPrecision("16-mixed", initial_scale=2.0**16, growth_interval=1000, hysteresis=2, min_scale=1.0)],
    )
    assert from_json.strategy.zero_config == explicit.strategy.zero_config
    a, b = from_json.strategy.precision_plugin, explicit.strategy.precision_plugin
    assert isinstance(a, ZeroPrecision) and a.precision == b.precision == "16-mixed"
    assert a.scaler.config == b.scaler.config
    assert not (dist.is_available() and dist.is_initialized())


def test_settings_are_split_by_who_applies_them():
    settings = parse_deepspeed_config(EXAMPLE)
    assert settings.gradient_clip_val == 1.0
    assert settings.accumulate_grad_batches == 2
    assert settings.micro_batch_size == 4 and settings.train_batch_size == 16
    assert settings.optimizer == {"type": "adam", "params": json.loads(EXAMPLE.read_text())["optimizer"]["params"]}
    assert settings.scheduler["type"] == "WarmupLR"


def test_a_dict_works_like_a_file():
    assert parse_deepspeed_config(json.loads(EXAMPLE.read_text())) == parse_deepspeed_config(EXAMPLE)


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
            ["offload_optimizer.device", "'cpu'"],
        ),
        ({"zero_optimization": {"stage": 0}}, ["zero_optimization.stage=0", "1, 2 or 3"]),
        (
            {"zero_optimization": {"stage": 2, "reduce_buket_size": 5e8}},
            ["reduce_buket_size", "Did you mean 'reduce_bucket_size'"],
        ),
        ({"optimizer": {"type": "Lamb", "params": {}}}, ["optimizer.type='Lamb'", "AdamW"]),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
            ["optimizer.params.max_grad_norm"],
        ),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, ["scheduler.type='OneCycle'", "WarmupLR"]),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["fp16.enabled", "bf16.enabled"]),
        ({"fp16": {"enabled": True, "loss_scale_windw": 100}}, ["loss_scale_windw"]),
        ({"pipeline": {"stages": 2}}, ["`pipeline`", "Supported keys"]),
        ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps", ">= 1"]),
        ({"activation_checkpointing": {"partition_activations": False}}, ["activation_checkpointing", "classes"]),
    ],
)
def test_unsupported_keys_and_values_are_errors_naming_them(config, needles):
    with pytest.raises(ZeroConfigError) as err:
        ZeroStrategy(config=config)
    for needle in needles:
        assert needle in str(err.value)


def test_tuning_keys_are_warnings_naming_them():
    with pytest.warns(UserWarning, match="steps_per_print"):
        ZeroStrategy(config={"steps_per_print": 10, "zero_optimization": {"stage": 1}})


@pytest.mark.parametrize(
    ("config", "supported", "ignored"),
    [
        ({"pipeline": {"stages": 2}}, "'zero_optimization'", "'steps_per_print'"),
        ({"zero_optimization": {"stage": 2, "prefetch": 1}}, "'reduce_bucket_size'", "'allgather_bucket_size'"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "fast": 1}}},
            "'pin_memory'",
            "'buffer_count'",
        ),
    ],
)
def test_the_error_lists_the_keys_accepted_with_a_warning_too(config, supported, ignored):
    """A key that works with a warning must not look refused: the error's list names it, marked as ignored."""
    with pytest.raises(ZeroConfigError) as err:
        ZeroStrategy(config=config)
    text = str(err.value)
    listed, _, rest = text.partition("Supported keys here: ")
    mapped, _, accepted = rest.partition(" Also accepted and ignored, with a warning (they tune DeepSpeed itself): ")
    assert supported in mapped and ignored not in mapped
    assert ignored in accepted and supported not in accepted


@pytest.mark.parametrize(
    ("strategy_kwargs", "trainer_kwargs", "needle"),
    [
        (dict(stage=3), {}, "`stage` is given both"),
        (dict(overlap_comm=False), {}, "`overlap_comm` is given both"),
        ({}, dict(precision="bf16-mixed"), "Precision is given both"),
        ({}, dict(plugins=[ZeroPrecision("16-mixed", initial_scale=8.0)]), "Precision is given both"),
    ],
)
def test_a_setting_given_twice_with_different_values_is_an_error(strategy_kwargs, trainer_kwargs, needle):
    with pytest.raises(ZeroConfigError, match=needle):
        _trainer(ZeroStrategy(config=str(EXAMPLE), **strategy_kwargs), **trainer_kwargs)


@pytest.mark.parametrize(
    ("config", "trainer_kwargs", "batch", "needle"),
    [
        ({"gradient_clipping": 1.0}, dict(gradient_clip_val=2.0), 4, "Gradient clipping is given both"),
        ({"gradient_accumulation_steps": 2}, dict(accumulate_grad_batches=4), 4, "Gradient accumulation is given both"),
        (
            {"train_micro_batch_size_per_gpu": 8},
            {},
            4,
            "`train_micro_batch_size_per_gpu=8` but the training DataLoader",
        ),
        (
            {"train_batch_size": 8},
            {},
            2,
            "`train_batch_size=8` but batch 2 x accumulation 1 x 2 data-parallel replicas = 4",
        ),
    ],
)
def test_a_config_contradicting_the_trainer_or_its_dataloader_is_refused_before_any_process_starts(
    config, trainer_kwargs, batch, needle
):
    """The Trainer's settings and the training DataLoader only meet the strategy in ``fit``: its launcher refuses
    the contradiction there, before the two processes are spawned (a spawned rank's error would come back as
    another exception type, after the processes started and the process group formed)."""
    trainer = _trainer(ZeroStrategy(config=config, start_method="spawn"), max_steps=1, **trainer_kwargs)
    with pytest.raises(ZeroConfigError, match=needle):
        trainer.fit(models.Regression(), models.loader(models.IndexedData(), batch))
    assert not multiprocessing.active_children() and not dist.is_initialized()


def test_the_same_value_given_twice_is_fine():
    strategy = ZeroStrategy(config=str(EXAMPLE), stage=2, offload_optimizer=True)
    assert strategy.zero_config.stage == 2


def test_activation_checkpointing_section_takes_its_modules_from_the_argument():
    from lightning_zero.demo.gpt import Block

    strategy = ZeroStrategy(
        config={"activation_checkpointing": {"partition_activations": False}}, activation_checkpointing=Block
    )
    assert "Block" in strategy.checkpoint_policy.description


def test_warmup_schedules_follow_deepspeed():
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    linear = DeepSpeedWarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        linear.step()
    assert lrs == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    decay = DeepSpeedWarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear", total_num_steps=6)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        decay.step()
    assert lrs == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]


def test_zero3_offload_sections_map_onto_parameter_and_optimizer_offload():
    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "offload_param": {"device": "cpu", "pin_memory": False},
            "stage3_max_live_parameters": 1e9,
        }
    }
    with pytest.warns(UserWarning, match="stage3_max_live_parameters"):
        from_json = ZeroStrategy(config=config).zero_config
    assert from_json == ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, pin_memory=False).zero_config


def test_bf16_optimizer_states_map_onto_optimizer_state_dtype():
    """DeepSpeed's ``bf16.bf16_optimizer_states``; its other low-precision key (bf16 masters) is refused by name."""
    config = {"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}}
    assert ZeroStrategy(config=config).zero_config == ZeroStrategy(stage=2, optimizer_state_dtype="bf16").zero_config
    config["bf16"]["bf16_optimizer_states"] = "yes"
    with pytest.raises(ZeroConfigError, match="bf16.bf16_optimizer_states` must be true or false"):
        ZeroStrategy(config=config)
    with pytest.raises(ZeroConfigError, match="bf16_master_weights_and_grads"):
        ZeroStrategy(config={"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    given_twice = {"bf16": {"enabled": True, "bf16_optimizer_states": False}}
    with pytest.raises(ZeroConfigError, match="optimizer_state_dtype"):
        ZeroStrategy(config=given_twice, optimizer_state_dtype="bf16")


def test_zenflow_maps_onto_selective_updates():
    """DeepSpeed's tutorial block, as written there, is selective updates; what they cannot repeat is refused by
    key: an "auto" update interval (timing-driven, so runs differ), warm-up rounds, unknown keys."""
    zenflow = {
        "topk_ratio": 0.05,
        "select_strategy": "auto",
        "select_interval": "auto",
        "update_interval": 4,
        "full_warm_up_rounds": 0,
        "overlap_step": True,
    }
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}}
    expected = ZeroStrategy(stage=2, offload_optimizer=True, offload_update_interval=4, offload_topk_ratio=0.05)
    assert ZeroStrategy(config=config).zero_config == expected.zero_config
    synchronous = {**config["zero_optimization"], "zenflow": {**zenflow, "overlap_step": False}}
    assert ZeroStrategy(config={"zero_optimization": synchronous}).zero_config.offload_overlap_step is False
    for change, message in [
        ({"update_interval": "auto"}, "update_interval` must be an integer >= 2"),
        ({"overlap_step": "no"}, "overlap_step` must be true or false"),
        ({"full_warm_up_rounds": 10}, "full_warm_up_rounds=10` is not supported"),
        ({"select_strategy": "epoch"}, "select_strategy='epoch'` is not supported"),
        ({"steps_per_epoch": 100}, "zenflow.steps_per_epoch` is not supported"),
    ]:
        block = {**config["zero_optimization"], "zenflow": {**zenflow, **change}}
        with pytest.raises(ZeroConfigError, match=message):
            ZeroStrategy(config={"zero_optimization": block})
