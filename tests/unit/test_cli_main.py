"""`lightning_zero.cli.main` in-process with `--print_config`: LightningCLI parses what we composed, and
its own `--key value` syntax composes with ours. Nothing is trained and no process is started."""

from __future__ import annotations

import pytest
import yaml

from lightning_zero.cli import main
from tests.launch import REPO

MAIN = str(REPO / "conf" / "gpt_zero3.yaml")


def printed(capsys, *argv: str) -> dict:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *argv, "--print_config"])
    assert exit_.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_lightning_cli_arguments_after_the_config_win_over_it(capsys):
    config = printed(capsys, "--config", MAIN, "trainer.max_steps=5", "--trainer.max_steps", "3", "--model.n_layer", "1")
    assert config["trainer"]["max_steps"] == 3
    assert config["trainer"]["val_check_interval"] == 5  # interpolated before LightningCLI saw --trainer.max_steps
    assert config["model"]["init_args"]["n_layer"] == 1


def test_a_deepspeed_dict_in_yaml_and_a_registered_name(capsys, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(
        "defaults: [{model: gpt_tiny}, {data: chars}]\n"
        "trainer:\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n"
        "    init_args: {config: {zero_optimization: {stage: 3, reduce_bucket_size: 1000}, gradient_clipping: 0.5}}\n"
    )
    config = printed(capsys, "--config", str(run))
    assert config["trainer"]["strategy"]["init_args"]["config"]["zero_optimization"]["stage"] == 3
    run.write_text("defaults: [{model: gpt_tiny}, {data: chars}]\ntrainer: {strategy: zero3_offload}\n")
    assert printed(capsys, "--config", str(run))["trainer"]["strategy"] == "zero3_offload"


def test_errors_return_status_2_with_the_message(capsys):
    assert main(["fit", "--config", MAIN, "trainer.max_stpes=3"]) == 2
    assert "Did you mean 'trainer.max_steps'?" in capsys.readouterr().err
    assert main(["fit", "--config", MAIN, "strategy.config={zero_optimization: {stage: 2}}"]) == 2
    assert "`stage` is given both in the DeepSpeed config (2) and as a ZeroStrategy argument (3)" in capsys.readouterr().err
