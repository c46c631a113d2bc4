"""Composition of `lightning-zero` configs: defaults lists, groups, overrides, shorthands and the errors.

In-process and fast: these check the composed dict that LightningCLI would receive. The command run as
a user runs it (subprocesses, real Trainer runs) is in tests/integration/test_cli.py.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml

from lightning_zero.cli import main as lightning_zero_command
from lightning_zero.cli.command_line import CommandLine, Override, parse_value
from lightning_zero.cli.compose import compose, compose_keeping_interpolations, keep_interpolations, merge
from lightning_zero.cli.errors import CLIConfigError
from lightning_zero.cli.schema import LightningSchema
from tests.launch import REPO

CONF = REPO / "conf"


def composed(*args: str, roots=None, subcommand: str = "fit") -> dict:
    return compose(CommandLine.parse([subcommand, *args]), LightningSchema(subcommand), roots=roots)


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------------------------ command line


def test_command_line_splits_overrides_from_lightning_arguments():
    command = CommandLine.parse(
        [
            "fit",
            "--trainer.devices",
            "2",
            "--config",
            "a.yaml",
            "trainer.max_steps=5",
            "-c",
            "b.yaml",
            "+x.y=1",
            "~trainer.logger",
            "--trainer.strategy",
            "zero3",
            "++z=2",
            "--print_config",
            "model.n_layer=4",
        ]
    )
    assert command.configs == ["a.yaml", "b.yaml"]
    assert [(o.op, o.key, o.value) for o in command.overrides] == [
        ("set", "trainer.max_steps", "5"),
        ("add", "x.y", "1"),
        ("delete", "trainer.logger", None),
        ("force", "z", "2"),
        ("set", "model.n_layer", "4"),
    ]
    assert command.cli_args == ["--trainer.devices", "2", "--trainer.strategy", "zero3", "--print_config"]
    # the composed config goes where the first --config was, so later LightningCLI arguments still win
    assert command.lightning_argv({"a": 1})[:5] == ["fit", "--trainer.devices", "2", "--config", "a: 1\n"]
    # every --config file is composed first, so a LightningCLI argument between two would lose its place
    with pytest.raises(CLIConfigError, match="'--trainer.max_steps' stands between two --config files"):
        CommandLine.parse(["fit", "--config", "a.yaml", "--trainer.max_steps", "3", "--config", "b.yaml"])
    with pytest.raises(CLIConfigError, match="--config needs a file"):
        CommandLine.parse(["fit", "--config="])


def test_a_value_of_a_lightning_option_is_not_taken_for_an_override():
    command = CommandLine.parse(
        ["fit", "--trainer.default_root_dir", "runs/a=b", "x=1", "--trainer.max_steps", "-1", "y=2"]
    )
    assert command.cli_args == ["--trainer.default_root_dir", "runs/a=b", "--trainer.max_steps", "-1"]
    assert [o.text for o in command.overrides] == ["x=1", "y=2"]
    assert not CommandLine.parse(["fit", "--trainer.max_steps", "3"]).composes


@pytest.mark.parametrize(
    "text, value",
    [
        ("3", 3),
        ("-1", -1),
        ("1e-3", 1e-3),
        ("2.0e-3", 2e-3),
        ("true", True),
        ("False", False),
        ("null", None),
        ("[1, 2]", [1, 2]),
        ("{a: 1}", {"a": 1}),
        ("zero3", "zero3"),
        ("${model.x}", "${model.x}"),
        ("", ""),
        ("'3'", "3"),
        ("exp #1", "exp #1"),
        ("run: 2", "run: 2"),
        ("1:30", "1:30"),
        ("yes", "yes"),
        ("2024-01-01", "2024-01-01"),
        ("01", 1),
    ],
)
def test_override_values_read_as_yaml(text, value):
    assert parse_value(text) == value


def test_tokens_that_are_not_overrides():
    assert Override.parse("plain") is None
    assert Override.parse("--a=b") is None
    assert Override.parse("~a.b").op == "delete"


# ------------------------------------------------------------------------------------ defaults and groups


def test_the_shipped_main_config_composes_its_groups_and_interpolations():
    config = composed("--config", str(CONF / "gpt_zero3.yaml"))
    assert config["trainer"]["strategy"] == {"class_path": "lightning_zero.ZeroStrategy", "init_args": {"stage": 3}}
    assert config["model"]["class_path"] == "lightning_zero.demo.GPTLightningModule"
    assert config["data"]["init_args"]["block_size"] == config["model"]["init_args"]["block_size"] == 64
    assert config["trainer"]["val_check_interval"] == config["trainer"]["max_steps"]
    assert config["trainer"]["logger"]["init_args"]["save_dir"] == config["trainer"]["default_root_dir"]
    assert "defaults" not in config


def test_every_override_form_on_the_main_config():
    config = composed(
        "--config",
        str(CONF / "gpt_zero3.yaml"),
        "strategy=zero2_offload",
        "model=gpt_tiny",
        "trainer.max_steps=7",
        "model.n_layer=3",
        "strategy.bucket_size_mb=5",
        "+trainer.limit_val_batches=2",
        "~trainer.logger",
        "data.batch_size=4",
        "++seed_everything=7",
    )
    assert config["trainer"]["strategy"]["init_args"] == {"stage": 2, "offload_optimizer": True, "bucket_size_mb": 5}
    assert config["model"]["init_args"]["n_embd"] == 32  # gpt_tiny
    assert config["model"]["init_args"]["n_layer"] == 3
    assert config["trainer"]["max_steps"] == 7 and config["trainer"]["val_check_interval"] == 7  # resolved late
    assert config["data"]["init_args"] == {"block_size": 32, "batch_size": 4, "num_tokens": 200000}
    assert config["trainer"]["limit_val_batches"] == 2
    assert config["trainer"]["logger"] is False  # off, not Lightning's default logger
    assert config["seed_everything"] == 7


def test_defaults_order_self_packages_and_nested_files(tmp_path):
    write(tmp_path, "base.yaml", "trainer: {max_steps: 1, devices: 1}\n")
    write(
        tmp_path,
        "strategy/a.yaml",
        "# @package trainer.strategy\nclass_path: lightning_zero.ZeroStrategy\ninit_args: {stage: 1}\n",
    )
    write(tmp_path, "extra/opt.yaml", "# @package _global_\ntrainer: {max_steps: 9}\nseed_everything: 3\n")
    write(tmp_path, "model/m.yaml", "class_path: lightning_zero.demo.GPTLightningModule\ninit_args: {n_layer: 1}\n")
    main = write(
        tmp_path,
        "main.yaml",
        """
        defaults:
          - base
          - _self_
          - strategy: a
          - optional missing: nothing
          - extra: opt
        trainer: {max_steps: 5, strategy: zero3}
        """,
    )
    config = composed("--config", str(main), roots=[tmp_path])
    # _self_ before the groups: the groups win; `# @package` places the files; optional + missing is skipped
    assert config["trainer"] == {
        "max_steps": 9,
        "devices": 1,
        "strategy": {"class_path": "lightning_zero.ZeroStrategy", "init_args": {"stage": 1}},
    }
    assert config["seed_everything"] == 3
    # a group picked on the command line that no defaults list names is merged last
    assert composed("--config", str(main), "model=m", roots=[tmp_path])["model"]["init_args"] == {"n_layer": 1}
    # ~group drops it from the defaults
    assert composed("--config", str(main), "~extra", roots=[tmp_path])["trainer"]["max_steps"] == 5


def test_a_changed_class_path_replaces_the_node_instead_of_merging_into_it():
    old = {"class_path": "a.A", "init_args": {"x": 1}}
    assert merge({"s": old}, {"s": {"class_path": "b.B"}}) == {"s": {"class_path": "b.B"}}
    assert merge({"s": old}, {"s": {"class_path": "a.A", "init_args": {"y": 2}}})["s"]["init_args"] == {"x": 1, "y": 2}
    assert merge({"s": "zero3"}, {"s": old}) == {"s": old}


def test_a_registered_strategy_name_takes_shorthand_overrides(tmp_path):
    main = write(tmp_path, "main.yaml", "trainer: {strategy: zero3_offload}\n")
    config = composed("--config", str(main), "strategy.bucket_size_mb=2")
    assert config["trainer"]["strategy"] == {
        "class_path": "lightning_zero.strategy.zero_strategy.ZeroStrategy",
        "init_args": {"stage": 3, "offload_optimizer": True, "offload_params": True, "bucket_size_mb": 2},
    }


def test_groups_resolve_from_the_checkout_conf_when_the_config_lives_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = write(tmp_path, "printed.yaml", "trainer: {max_steps: 2}\n")
    config = composed("--config", str(main), "strategy=zero1", "model=gpt_tiny", "data=chars")
    assert config["trainer"]["strategy"]["init_args"] == {"stage": 1}
    assert config["data"]["init_args"]["block_size"] == 32


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "trainer.max_stpes=3",
            "unknown key 'trainer.max_stpes': lightning.pytorch.Trainer has no argument 'max_stpes'. Did you mean 'trainer.max_steps'?",
        ),
        ("+trainer.max_stpes=3", "Did you mean 'trainer.max_steps'?"),
        ("strategy.stgae=2", "lightning_zero.ZeroStrategy has no argument 'stgae'. Did you mean 'strategy.stage'?"),
        ("model.n_layr=2", "GPTLightningModule has no argument 'n_layr'. Did you mean 'model.n_layer'?"),
        ("stratgy=zero3", "Did you mean 'strategy'?"),
        ("strategy=zero4", "strategy=zero4 names no strategy/zero4.yaml"),
        ("model=gpt_smal", "Did you mean 'gpt_small'?"),
        ("+trainer.max_steps=3", "trainer.max_steps is already set (to 150); override it with 'trainer.max_steps=3'"),
        ("~trainer.max_stpes", "Did you mean 'trainer.max_steps'?"),
        ("trainer.max_steps.x=1", "`trainer.max_steps` is 150, not a mapping"),
        ("trainer.max_steps=${nowhere}", "cannot resolve interpolation at trainer.max_steps"),
    ],
)
def test_override_errors_name_the_key_and_the_nearest_valid_one(override, message):
    with pytest.raises(CLIConfigError) as err:
        composed("--config", str(CONF / "gpt_zero3.yaml"), override)
    assert message in str(err.value)


def test_unknown_group_option_lists_the_options():
    with pytest.raises(
        CLIConfigError,
        match=r"choose one of \['ddp', .*'zero3', 'zero3_compressed', 'zero3_hpz', 'zero3_hsdp', 'zero3_offload', 'zero3_offload_optimizer', 'zero_auto'\]\. Did you mean 'zero3'\?",
    ):
        composed("--config", str(CONF / "gpt_zero3.yaml"), "strategy=zero4")


def test_typos_inside_yaml_files_are_found_too(tmp_path):
    cases = {
        "trainer: {max_stpes: 3}\n": "unknown key 'trainer.max_stpes'",
        "modle: {}\n": "Did you mean 'model'?",
        "model: {class_path: lightning_zero.demo.GPTLightningModul}\n": "Did you mean 'GPTLightningModule'?",
        "model: {class_path: lightning_zero.demo.GPTLightningModule, init_args: {n_layr: 1}}\n": "model.init_args.n_layr",
        "trainer: {callbacks: [{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {every_n_step: 1}}]}\n": "Did you mean 'every_n_train_steps'?",
        "model: {class_path: no_such_module.Model}\n": "cannot be imported",
        "defaults: [{strategy: zero9}]\n": "main.yaml, defaults: strategy=zero9 names no strategy/zero9.yaml",
    }
    for text, message in cases.items():
        main = write(tmp_path, "main.yaml", text)
        with pytest.raises(CLIConfigError) as err:
            composed("--config", str(main), roots=[tmp_path, CONF])
        assert message in str(err.value), (text, str(err.value))


def test_a_missing_config_file_suggests_the_nearest(tmp_path):
    with pytest.raises(CLIConfigError, match="does not exist. Did you mean 'conf/gpt_zero3.yaml'"):
        composed("--config", "conf/gpt_zero.yaml")


def test_subcommand_keys_follow_the_subcommand():
    main = str(CONF / "gpt_zero3.yaml")
    assert composed("--config", main, "+ckpt_path=last.ckpt", subcommand="validate")["ckpt_path"] == "last.ckpt"
    assert composed("--config", main, "+return_predictions=false", subcommand="predict")["return_predictions"] is False
    with pytest.raises(CLIConfigError, match="the `fit` config has no key 'return_predictions'"):
        composed("--config", main, "+return_predictions=false")


def test_list_items_are_addressed_by_index():
    main = str(CONF / "gpt_zero3.yaml")
    callbacks = (
        "++trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {save_top_k: 1}}]"
    )
    config = composed("--config", main, callbacks, "trainer.callbacks.0.save_top_k=3")
    assert config["trainer"]["callbacks"] == [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_top_k": 3}}
    ]
    with pytest.raises(CLIConfigError, match="Did you mean 'trainer.callbacks.0.save_top_k'"):
        composed("--config", main, callbacks, "trainer.callbacks.0.save_topk=3")


def test_yaml_is_read_by_omegaconf_and_a_defaults_cycle_is_an_error(tmp_path):
    main = write(
        tmp_path,
        "main.yaml",
        "defaults: [other]\nmodel: {class_path: lightning_zero.demo.GPTLightningModule, init_args: {learning_rate: 1e-3}}\n",
    )
    write(tmp_path, "other.yaml", "seed_everything: 1\n")
    assert composed("--config", str(main), roots=[tmp_path])["model"]["init_args"]["learning_rate"] == 1e-3
    write(tmp_path, "other.yaml", "defaults: [main]\n")
    with pytest.raises(CLIConfigError, match="defaults cycle"):
        composed("--config", str(main), roots=[tmp_path])


def test_override_in_a_defaults_list_replaces_the_option_of_a_nested_list(tmp_path):
    write(tmp_path, "base.yaml", "defaults: [{model: gpt_small}, {strategy: zero3_offload}]\n")
    main = write(tmp_path, "main.yaml", "defaults: [base, {override model: gpt_tiny}, {override strategy: zero2}]\n")
    config = composed("--config", str(main), roots=[tmp_path, CONF])
    assert "warmup_steps" not in config["model"]["init_args"]  # nothing of gpt_small leaks into gpt_tiny
    assert config["trainer"]["strategy"]["init_args"] == {"stage": 2}
    # the command line still wins over a file's override
    assert (
        composed("--config", str(main), "model=gpt_small", roots=[tmp_path, CONF])["model"]["init_args"]["n_layer"] == 4
    )
    write(tmp_path, "orphan.yaml", "defaults: [{override data: chars}]\n")
    with pytest.raises(CLIConfigError, match="`override data: ...` in a defaults list matches no `data` entry"):
        composed("--config", str(tmp_path / "orphan.yaml"), roots=[tmp_path, CONF])


def test_a_group_picked_for_a_config_without_defaults_replaces_its_node(tmp_path):
    printed = write(
        tmp_path,
        "printed.yaml",
        "trainer:\n  strategy: {class_path: lightning_zero.ZeroStrategy, init_args: {stage: 3, offload_optimizer: true, offload_params: true}}\n"
        "model: {class_path: lightning_zero.demo.GPTLightningModule, init_args: {n_layer: 1}}\n",
    )
    config = composed("--config", str(printed), "strategy=zero2", roots=[CONF])
    assert config["trainer"]["strategy"] == {"class_path": "lightning_zero.ZeroStrategy", "init_args": {"stage": 2}}
    assert "strategy" not in composed("--config", str(printed), "~strategy", roots=[CONF])["trainer"]
    assert "model" not in composed("--config", str(printed), "~model", roots=[CONF])


def test_list_items_and_missing_keys_are_errors_not_crashes():
    main = str(CONF / "gpt_zero3.yaml")
    callbacks = "++trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint}]"
    assert composed("--config", main, callbacks, "~trainer.callbacks.0")["trainer"]["callbacks"] == []
    replaced = composed(
        "--config", main, callbacks, "trainer.callbacks.0={class_path: lightning.pytorch.callbacks.Timer}"
    )
    assert replaced["trainer"]["callbacks"] == [{"class_path": "lightning.pytorch.callbacks.Timer"}]
    for override, message in [
        ("trainer.callbacks.3.save_top_k=2", "`trainer.callbacks` is a list of 1; '3' is not an index of it"),
        ("trainer.callbacks.foo=1", "'foo' is not an index of it"),
        ("~trainer.gradient_clip_val", "not in the config, so there is nothing to delete"),
        ("trainer=3", "`trainer` must be a mapping"),
    ]:
        with pytest.raises(CLIConfigError, match=re.escape(message)):
            composed("--config", main, callbacks, override)


def test_unrelated_folders_next_to_a_config_do_not_hide_the_groups(tmp_path):
    (tmp_path / "model").mkdir()  # e.g. a folder of weights: no YAML in it
    (tmp_path / "strategy").mkdir()
    write(tmp_path, "strategy/mine.yaml", "# @package trainer.strategy\ndefaults: [common]\ninit_args: {stage: 1}\n")
    write(tmp_path, "strategy/common.yaml", "class_path: lightning_zero.ZeroStrategy\ninit_args: {bucket_size_mb: 4}\n")
    main = write(tmp_path, "run.yaml", "defaults: [{model: gpt_tiny}, {data: chars}, {strategy: mine}]\n")
    config = composed("--config", str(main), roots=[tmp_path, CONF])
    assert config["model"]["init_args"]["n_layer"] == 2
    # a file named in a group file's defaults lands in that group's package
    assert config["trainer"]["strategy"] == {
        "class_path": "lightning_zero.ZeroStrategy",
        "init_args": {"bucket_size_mb": 4, "stage": 1},
    }
    write(tmp_path, "odd.yaml", "1: 2\n")
    with pytest.raises(CLIConfigError, match="unknown key '1'"):
        composed("--config", str(tmp_path / "odd.yaml"), roots=[tmp_path])


# ------------------------------------------------------------------------------------ deleted logger, printed configs


def test_deleting_the_logger_switches_logging_off():
    """Lightning makes its default logger for a Trainer given none, so Hydra's `~trainer.logger` (remove the
    configured logger) means `logger: false`; also where the config names no logger, as Lightning's default is one."""
    main = str(CONF / "gpt_zero3.yaml")
    assert composed("--config", main, "~trainer.logger")["trainer"]["logger"] is False
    assert composed("--config", main, "~trainer.logger", "~trainer.logger")["trainer"]["logger"] is False
    assert composed("--config", main, "~trainer.logger", "~trainer.logger=false")["trainer"]["logger"] is False
    with pytest.raises(CLIConfigError, match="trainer.logger is .* not true"):  # `~key=value` still checks the value
        composed("--config", main, "~trainer.logger=true")
    # the keys below it are deleted as any key is
    config = composed("--config", main, "~trainer.logger.save_dir")
    assert "save_dir" not in config["trainer"]["logger"]["init_args"]


def printed(capsys, *argv: str) -> str:
    """`lightning-zero fit ... --print_config`, in-process: LightningCLI parses the composed config and prints it."""
    with pytest.raises(SystemExit) as exit_:
        lightning_zero_command(["fit", *argv, "--print_config"])
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out


def test_a_printed_config_keeps_its_interpolations_so_overrides_still_move_them(capsys, tmp_path):
    """Issue 78: `--print_config > run.yaml` then `--config run.yaml trainer.max_steps=5` validated and saved at
    step 150 because the printed values were resolved; printed, the `${...}` stay, and the file prints itself."""
    run = tmp_path / "run.yaml"
    run.write_text(printed(capsys, "--config", str(CONF / "gpt_zero3.yaml"), "~trainer.logger"))
    config = yaml.safe_load(run.read_text())
    trainer = config["trainer"]
    checkpoint = trainer["callbacks"][0]["init_args"]
    assert trainer["val_check_interval"] == checkpoint["every_n_train_steps"] == "${trainer.max_steps}"
    assert checkpoint["dirpath"] == "${trainer.default_root_dir}/checkpoints"
    assert config["data"]["init_args"]["block_size"] == "${model.init_args.block_size}"
    assert trainer["logger"] is False and trainer["max_steps"] == 150  # everything else as LightningCLI prints it
    assert printed(capsys, "--config", str(run)) == run.read_text()
    fed_back = composed("--config", str(run), "trainer.max_steps=5", "trainer.default_root_dir=elsewhere")
    assert fed_back["trainer"]["val_check_interval"] == 5
    assert fed_back["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] == 5
    assert fed_back["trainer"]["callbacks"][0]["init_args"]["dirpath"] == "elsewhere/checkpoints"
    assert fed_back["trainer"]["logger"] is False


def test_a_printed_interpolation_is_kept_only_where_it_gives_the_printed_value(capsys):
    """A LightningCLI argument after the config (`--trainer.max_steps 3`) is applied after the interpolations were
    resolved: the run validates at step 5, so the printed config says 5, not `${trainer.max_steps}`."""
    out = printed(capsys, "--config", str(CONF / "gpt_zero3.yaml"), "trainer.max_steps=5", "--trainer.max_steps", "3")
    trainer = yaml.safe_load(out)["trainer"]
    assert trainer["max_steps"] == 3 and trainer["val_check_interval"] == 5
    assert trainer["callbacks"][0]["init_args"]["every_n_train_steps"] == 5
    assert trainer["callbacks"][0]["init_args"]["dirpath"] == "${trainer.default_root_dir}/checkpoints"
    # the rule itself: a value put back resolved makes the interpolations that read it agree again
    resolved, unresolved = compose_keeping_interpolations(
        CommandLine.parse(["fit", "--config", str(CONF / "gpt_zero3.yaml")]), LightningSchema("fit")
    )
    unresolved["trainer"]["limit_val_batches"] = "${trainer.val_check_interval}"
    resolved["trainer"]["limit_val_batches"] = 150
    resolved["trainer"]["val_check_interval"] = 7  # changed after composition
    kept = keep_interpolations(resolved, unresolved)["trainer"]
    assert kept["val_check_interval"] == 7 and kept["limit_val_batches"] == 150
    assert keep_interpolations({"other": 1}, unresolved) == {"other": 1}  # keys printed elsewhere: nothing to keep
