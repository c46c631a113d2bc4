"""Communication compression settings without processes: defaults, their errors (before any process group exists),
the DeepSpeed `compression` block and ZeRO++ keys, the registered names and their conf/strategy files."""

import dataclasses
import inspect

import lightning as L
import pytest
import torch.distributed as dist
import yaml
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero import ZeroConfig, ZeroConfigError, ZeroStrategy
from lightning_zero.cli.command_line import CommandLine
from lightning_zero.cli.compose import compose
from lightning_zero.cli.schema import LightningSchema
from lightning_zero.config.zero_config import REGISTERED_STRATEGIES
from lightning_zero.deepspeed_compat.config import parse_deepspeed_config
from tests.launch import REPO

#: The block the issue says users will paste as it is.
PASTED = {
    "enabled": True,
    "compression_type": "fp16",
    "quantization_type": "asymmetric_quantization_signed",
    "quantization_bits": 8,
    "error_feedback": True,
    "all_gather_fp16": True,
}
COMPRESSION_FIELDS = (
    "gradient_compression",
    "param_compression",
    "quantization_scheme",
    "quantization_block_size",
    "error_feedback",
    "compression_scope",
)


def _compression(config: ZeroConfig) -> dict:
    return {name: getattr(config, name) for name in COMPRESSION_FIELDS}


def test_defaults_compress_nothing():
    config = ZeroStrategy().zero_config
    assert _compression(config) == dict(
        gradient_compression=None,
        param_compression=None,
        quantization_scheme="symmetric",
        quantization_block_size=2048,
        error_feedback=False,
        compression_scope="all",
    )
    assert not config.compresses


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gradient_compression="fp16"),
        dict(param_compression="bf16"),
        dict(
            stage=3,
            gradient_compression="int4",
            error_feedback=True,
            param_compression="int8",
            quantization_scheme="asymmetric",
            quantization_block_size=64,
        ),
        dict(shard_size="node", gradient_compression="int8", error_feedback=True, compression_scope="inter_node"),
        dict(shard_size="2", gradient_compression="bf16", compression_scope="inter_node"),  # "2" from a command line
    ],
)
def test_good_settings_are_kept(kwargs):
    config = ZeroStrategy(**kwargs).zero_config
    assert config.compresses
    for name in COMPRESSION_FIELDS:
        if name in kwargs:
            assert getattr(config, name) == kwargs[name]


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        (dict(gradient_compression="int9"), ["gradient_compression='int9'", "'int8'", "Did you mean 'int8'"]),
        (dict(gradient_compression="fp32"), ["gradient_compression='fp32'", "None, 'fp16', 'bf16', 'int8', 'int4'"]),
        (dict(param_compression="int2"), ["param_compression='int2'", "'int4'"]),
        (dict(quantization_scheme="asymetric"), ["quantization_scheme", "'symmetric', 'asymmetric'", "Did you mean"]),
        (
            dict(compression_scope="inter-node"),
            ["compression_scope", "'all', 'inter_node'", "Did you mean 'inter_node'"],
        ),
        (
            dict(gradient_compression="int8", quantization_block_size=3),
            ["quantization_block_size", "even integer >= 2", "got 3"],
        ),
        (dict(gradient_compression="int4", quantization_block_size=0), ["quantization_block_size", "got 0"]),
        (dict(gradient_compression="int8", quantization_block_size=True), ["quantization_block_size", "got True"]),
        (dict(gradient_compression="int8", quantization_block_size=64.0), ["quantization_block_size", "got 64.0"]),
        (
            dict(error_feedback=True),
            [
                "error_feedback=True",
                "gradient_compression=None",
                "error feedback needs quantized gradients: set gradient_compression='int8' or 'int4'",
            ],
        ),
        (
            dict(error_feedback=True, gradient_compression="bf16"),
            ["error_feedback", "gradient_compression='bf16'", "'int8' or 'int4'"],
        ),
        (dict(error_feedback="yes", gradient_compression="int8"), ["error_feedback", "True or False"]),
        (
            dict(gradient_compression="int8", compression_scope="inter_node"),
            ["compression_scope='inter_node'", "shard_size", "compression_scope='all'"],
        ),
        (
            dict(shard_size=2, gradient_compression="int8", param_compression="int8", compression_scope="inter_node"),
            [
                "compression_scope='inter_node'",
                "param_compression='int8'",
                "never across nodes",
                "param_compression=None",
            ],
        ),
        (
            dict(shard_size=2, compression_scope="inter_node"),
            [
                "compression_scope='inter_node'",
                "nothing to compress",
                "gradient_compression",
                "compression_scope='all'",
            ],
        ),
    ],
)
def test_bad_settings_name_the_setting_the_choices_and_the_fix(kwargs, needles):
    with pytest.raises(ZeroConfigError) as err:
        ZeroStrategy(**kwargs)
    for needle in needles:
        assert needle in str(err.value)
    assert not (dist.is_available() and dist.is_initialized())


def test_every_config_field_is_a_typed_keyword_of_the_strategy():
    """LightningCLI sees ZeroStrategy's signature, so every setting needs a parameter there with the same default."""
    parameters = inspect.signature(ZeroStrategy.__init__).parameters
    for field in dataclasses.fields(ZeroConfig):
        assert field.name in parameters, field.name
        assert parameters[field.name].default == field.default, field.name
        assert parameters[field.name].annotation is not inspect.Parameter.empty, field.name


def test_the_cli_parser_knows_the_choices():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(
        ZeroStrategy,
        "strategy",
        skip={"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"},
    )
    args = parser.parse_args(
        [
            "--strategy.gradient_compression=int8",
            "--strategy.quantization_block_size=1024",
            "--strategy.error_feedback=true",
            "--strategy.quantization_scheme=asymmetric",
        ]
    ).strategy
    assert (args.gradient_compression, args.quantization_block_size, args.error_feedback) == ("int8", 1024, True)
    with pytest.raises(Exception, match="gradient_compression"):
        parser.parse_args(["--strategy.gradient_compression=int9"])


# ------------------------------------------------------------------------------------ DeepSpeed keys


def test_the_pasted_compression_block_maps_onto_the_arguments():
    config = ZeroStrategy(config={"compression": PASTED}).zero_config
    assert _compression(config) == dict(
        gradient_compression="int8",
        param_compression="fp16",
        quantization_scheme="asymmetric",
        quantization_block_size=2048,
        error_feedback=True,
        compression_scope="all",
    )
    assert (
        config
        == ZeroStrategy(
            gradient_compression="int8", quantization_scheme="asymmetric", error_feedback=True, param_compression="fp16"
        ).zero_config
    )
    assert parse_deepspeed_config({"compression": PASTED}).strategy == dict(
        gradient_compression="int8", quantization_scheme="asymmetric", error_feedback=True, param_compression="fp16"
    )


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (
            {"enabled": True, "quantization_bits": 4, "quantization_type": "symmetric_quantization_signed"},
            dict(gradient_compression="int4", quantization_scheme="symmetric"),
        ),
        ({"enabled": True, "compression_type": "bf16", "quantization_bits": 16}, dict(gradient_compression="bf16")),
        ({"enabled": True, "compression_type": "fp16"}, dict(gradient_compression="fp16")),
        ({"enabled": True, "compression_type": "none", "quantization_bits": 32}, dict(gradient_compression=None)),
        ({"enabled": True, "all_gather_fp16": True}, dict(param_compression="fp16")),
        ({"enabled": True, "all_gather_fp16": False}, {}),
        ({"quantization_bits": 8}, dict(gradient_compression="int8")),  # no `enabled`: the block is the request
        ({**PASTED, "enabled": False}, {}),  # off: maps nothing
    ],
)
def test_compression_block_mapping(block, expected):
    assert parse_deepspeed_config({"compression": block}).strategy == expected


def test_disabled_block_changes_nothing_but_is_still_checked():
    assert not ZeroStrategy(config={"compression": {**PASTED, "enabled": False}}).zero_config.compresses
    with pytest.raises(ZeroConfigError, match="compression.quantization_bits=3"):
        ZeroStrategy(config={"compression": {"enabled": False, "quantization_bits": 3}})


def test_zero_plus_plus_keys_map_onto_int8():
    config = ZeroStrategy(
        config={"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}}
    ).zero_config
    assert (config.stage, config.param_compression, config.gradient_compression) == (3, "int8", "int8")
    off = ZeroStrategy(
        config={
            "zero_optimization": {
                "zero_quantized_weights": False,
                "zero_quantized_gradients": False,
                "zero_quantized_nontrainable_weights": False,
            }
        }
    ).zero_config
    assert not off.compresses
    # both places asking for the same thing is fine
    same = {
        "compression": {"quantization_bits": 8, "error_feedback": True},
        "zero_optimization": {"stage": 2, "zero_quantized_gradients": True},
    }
    assert (
        ZeroStrategy(config=same).zero_config == ZeroStrategy(**REGISTERED_STRATEGIES["zero2_compressed"]).zero_config
    )


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        (
            {"compression": {"quantization_bits": 4}, "zero_optimization": {"zero_quantized_gradients": True}},
            [
                "compression.quantization_bits=4",
                "zero_optimization.zero_quantized_gradients=true",
                "gradient_compression",
                "one place",
            ],
        ),
        (
            {"compression": {"compression_type": "none"}, "zero_optimization": {"zero_quantized_gradients": True}},
            ["compression.compression_type", "zero_optimization.zero_quantized_gradients", "gradient_compression"],
        ),
        (
            {
                "compression": {"all_gather_fp16": True},
                "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
            },
            ["compression.all_gather_fp16=true", "zero_optimization.zero_quantized_weights=true", "param_compression"],
        ),
    ],
)
def test_compression_block_and_zero_plus_plus_keys_that_disagree_are_an_error_naming_both(config, needles):
    with pytest.raises(ZeroConfigError) as err:
        ZeroStrategy(config=config)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        (
            {"compression": {"quantization_bit": 8}},
            [
                "compression.quantization_bit",
                "Did you mean 'quantization_bits'",
                "Supported keys here",
                "all_gather_fp16",
            ],
        ),
        ({"compression": {"quantization_bits": 2}}, ["compression.quantization_bits=2", "8 or 4", "16 or 32"]),
        ({"compression": {"quantization_bits": "8"}}, ["compression.quantization_bits='8'"]),
        ({"compression": {"quantization_bits": True}}, ["compression.quantization_bits=True"]),
        (
            {"compression": {"quantization_type": "asymmetric"}},
            ["compression.quantization_type='asymmetric'", "Did you mean 'asymmetric_quantization_signed'"],
        ),
        (
            {"compression": {"compression_type": "fp8"}},
            ["compression.compression_type='fp8'", "'fp16', 'bf16', 'none'"],
        ),
        ({"compression": {"enabled": "true"}}, ["compression.enabled", "true or false"]),
        ({"compression": {"error_feedback": 1}}, ["compression.error_feedback", "true or false"]),
        ({"compression": {"all_gather_fp16": "yes"}}, ["compression.all_gather_fp16", "true or false"]),
        ({"compression": [8]}, ["`compression` must be an object"]),
        (
            {"zero_optimization": {"zero_quantized_weights": 1}},
            ["zero_optimization.zero_quantized_weights", "true or false"],
        ),
        (
            {"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
            ["zero_optimization.zero_quantized_nontrainable_weights", "not supported", "false"],
        ),
        ({"compression": {"error_feedback": True}}, ["error_feedback", "needs quantized gradients"]),
        ({"compression": {"quantization_bits": 8}, "zero_optimization": {"overlap_comm": True}}, None),
    ],
)
def test_bad_compression_keys_name_the_key(config, needles):
    if needles is None:  # a control: the same shapes, valid
        assert ZeroStrategy(config=config).zero_config.gradient_compression == "int8"
        return
    with pytest.raises(ZeroConfigError) as err:
        ZeroStrategy(config=config)
    for needle in needles:
        assert needle in str(err.value)


def test_a_compression_setting_given_twice_with_different_values_is_an_error():
    with pytest.raises(ZeroConfigError, match="`gradient_compression` is given both"):
        ZeroStrategy(config={"compression": {"quantization_bits": 8}}, gradient_compression="int4")
    with pytest.raises(ZeroConfigError, match="`error_feedback` is given both"):
        ZeroStrategy(config={"compression": {"quantization_bits": 8, "error_feedback": False}}, error_feedback=True)
    strategy = ZeroStrategy(
        config={"compression": {"quantization_bits": 8}}, gradient_compression="int8", error_feedback=True
    )
    assert strategy.zero_config.error_feedback


# ------------------------------------------------------------------------------------ names and conf files


@pytest.mark.parametrize("name", ["zero2_compressed", "zero3_compressed"])
def test_registered_names_build_the_strategy(name):
    assert name in StrategyRegistry
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.zero_config == ZeroStrategy(**REGISTERED_STRATEGIES[name]).zero_config
    config = trainer.strategy.zero_config
    assert config.compresses and config.error_feedback and config.gradient_compression == "int8"
    assert config.param_compression == ("int8" if name == "zero3_compressed" else None)
    assert not (dist.is_available() and dist.is_initialized())


@pytest.mark.parametrize("name", ["zero2_compressed", "zero3_compressed"])
def test_conf_strategy_files_match_the_registered_names(name):
    node = yaml.safe_load((REPO / "conf" / "strategy" / f"{name}.yaml").read_text())
    assert node == {"class_path": "lightning_zero.ZeroStrategy", "init_args": REGISTERED_STRATEGIES[name]}
    line = CommandLine.parse(["fit", "--config", "conf/gpt_zero3.yaml", f"strategy={name}"])
    composed = compose(line, LightningSchema("fit"))
    assert composed["trainer"]["strategy"]["init_args"] == REGISTERED_STRATEGIES[name]
    assert ZeroStrategy(**composed["trainer"]["strategy"]["init_args"]).zero_config.compresses


def test_yaml_override_reaches_the_compression_settings():
    line = CommandLine.parse(
        [
            "fit",
            "--config",
            "conf/gpt_zero3.yaml",
            "strategy=zero2_compressed",
            "strategy.quantization_block_size=512",
            "+strategy.quantization_scheme=asymmetric",
        ]
    )
    init_args = compose(line, LightningSchema("fit"))["trainer"]["strategy"]["init_args"]
    config = ZeroStrategy(**init_args).zero_config
    assert (config.quantization_block_size, config.quantization_scheme) == (512, "asymmetric")
