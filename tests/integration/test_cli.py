"""`lightning-zero fit|validate|test|predict` run as a user runs it: subprocesses, real Trainer runs on 2 ranks.

The composition rules themselves are covered in-process by tests/unit/test_cli_compose.py, the one-line errors by
tests/unit/test_cli_main.py, a DeepSpeed JSON in a real fit by tests/distributed/test_deepspeed_config.py, and
`fit` from YAML with overrides by the main job (test_main_job.py); the runs here that repeat them are
`make test-all`'s.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from lightning_zero import ZeroPrecision, ZeroStrategy
from tests.integration import background
from tests.launch import REPO

pytestmark = pytest.mark.slow

EXAMPLE = "tests/data/ds_zero2_offload_fp16.json"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_zero", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def overrides(out) -> list[str]:
    """conf/gpt_zero3.yaml turned into cli_python_run.py's run with every override form; `${}` interpolation
    carries model.block_size into the data and max_steps into val_check_interval."""
    return [
        "--config",
        "conf/gpt_zero3.yaml",
        "model=gpt_tiny",
        "strategy=zero2_offload",  # group selection
        "model.n_layer=1",
        "model.block_size=16",
        "data.batch_size=4",
        "trainer.max_steps=4",  # a.b=c (shorthands)
        "+trainer.limit_val_batches=2",  # add a key
        "~trainer.logger",  # drop a key (for the logger: logging off)
        f"trainer.default_root_dir={out}",
        "trainer.enable_progress_bar=false",
        f"++trainer.callbacks=[{{class_path: tests.integration.cli_support.RecordRun, init_args: {{path: {out}/cli.pt}}}}]",
    ]


@background.in_background
def test_fit_from_yaml_and_overrides_equals_the_same_run_configured_in_python(tmp_path):
    """(`make test` composes in-process, tests/unit/test_cli_compose.py, and trains the main job from YAML with
    overrides, test_main_job.py.)"""
    ok(cli("fit", *overrides(tmp_path)))
    ok(
        subprocess.run(
            [sys.executable, "-m", "tests.integration.cli_python_run", str(tmp_path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    from_cli = torch.load(tmp_path / "cli.pt", weights_only=True)
    from_python = torch.load(tmp_path / "python.pt", weights_only=True)
    assert from_cli["info"] == from_python["info"]
    assert from_cli["info"]["global_step"] == 4 and from_cli["info"]["data"]["block_size"] == 16
    assert "stage=2" in from_cli["info"]["zero_config"] and "offload_optimizer=True" in from_cli["info"]["zero_config"]
    assert from_cli["state"].keys() == from_python["state"].keys()
    for name, value in from_cli["state"].items():
        torch.testing.assert_close(value, from_python["state"][name], rtol=0, atol=0, msg=name)


@background.in_background
def test_the_printed_config_fed_back_prints_itself_and_trains_the_same_run(tmp_path):
    """--print_config shows the merged result; fed back with --config it prints itself and trains the same run
    (the printing alone is checked in-process by tests/unit/test_cli_main.py)."""
    ok(cli("fit", *overrides(tmp_path)))
    from_cli = torch.load(tmp_path / "cli.pt", weights_only=True)
    printed = tmp_path / "printed.yaml"
    printed.write_text(ok(cli("fit", *overrides(tmp_path), "--print_config")).stdout)
    config = yaml.safe_load(printed.read_text())
    assert config["trainer"]["strategy"]["init_args"]["stage"] == 2
    assert config["trainer"]["strategy"]["init_args"]["offload_optimizer"] is True
    assert config["model"]["init_args"]["n_layer"] == 1 and config["model"]["init_args"]["block_size"] == 16
    # the interpolations stay (a fed-back `trainer.max_steps=N` still moves val_check_interval), `~trainer.logger` is off
    assert config["data"]["init_args"]["block_size"] == "${model.init_args.block_size}"
    assert config["trainer"]["val_check_interval"] == "${trainer.max_steps}"
    assert config["trainer"]["limit_val_batches"] == 2 and config["trainer"]["logger"] is False
    assert ok(cli("fit", "--config", str(printed), "--print_config")).stdout == printed.read_text()
    ok(cli("fit", "--config", str(printed), f"trainer.callbacks.0.init_args.path={tmp_path}/printed.pt"))
    from_printed = torch.load(tmp_path / "printed.pt", weights_only=True)
    assert from_printed["info"] == from_cli["info"]
    for name, value in from_printed["state"].items():
        torch.testing.assert_close(value, from_cli["state"][name], rtol=0, atol=0, msg=name)


@background.in_background
def test_a_deepspeed_json_on_the_command_line_gives_the_explicit_arguments_run(tmp_path):
    """DeepSpeed's ZeRO-2 + CPU optimizer offload + fp16 example as `strategy.config=`: the strategy, precision,
    clipping, accumulation, optimizer and scheduler equal those of the explicit arguments."""
    ok(
        cli(
            "fit",
            "--config",
            "conf/gpt_zero3.yaml",
            "model=gpt_tiny",
            "strategy=zero2",
            "~strategy.stage",
            f"strategy.config={EXAMPLE}",
            "model.class_path=tests.integration.cli_support.OptimizerFromConfigGPT",
            "data.batch_size=4",
            "trainer.max_steps=3",
            "+trainer.limit_val_batches=1",
            "~trainer.logger",
            f"trainer.default_root_dir={tmp_path}",
            "trainer.enable_progress_bar=false",
            f"++trainer.callbacks=[{{class_path: tests.integration.cli_support.RecordRun, init_args: {{path: {tmp_path}/ds.pt}}}}]",
        )
    )
    info = torch.load(tmp_path / "ds.pt", weights_only=True)["info"]
    explicit = ZeroStrategy(stage=2, offload_optimizer=True, pin_memory=True, bucket_size_mb=2e8 * 4 / 2**20)
    precision = ZeroPrecision("16-mixed", initial_scale=2.0**16, growth_interval=1000, hysteresis=2, min_scale=1.0)
    assert info["zero_config"] == repr(explicit.zero_config)
    assert info["precision"] == "16-mixed" and info["loss_scale"] == repr(precision.scaler.config)
    assert (info["clip"], info["accumulate"], info["world_size"]) == (1.0, 2, 2)
    assert info["optimizer"] == "AdamW" and info["schedulers"] == ["DeepSpeedWarmupLR"]
    assert "('betas', (0.9, 0.95))" in info["param_group"] and "('weight_decay', 0.01)" in info["param_group"]


def evaluation_subcommands(root) -> str:
    """`validate`, `test` and `predict` on one process (`trainer.devices=1`: no launcher re-runs the command), each
    through the same entry point as `lightning-zero`, in one Python process to start Python once."""
    runs = [
        [
            subcommand,
            "--config",
            "conf/gpt_zero3.yaml",
            "model=gpt_tiny",
            "trainer.devices=1",
            f"+trainer.limit_{limit}_batches=2",
            "~trainer.logger",
            f"trainer.default_root_dir={root}",
            "trainer.enable_progress_bar=false",
        ]
        for subcommand, limit in (("validate", "val"), ("test", "test"), ("predict", "predict"))
    ]
    script = (
        "from lightning_zero.cli import main\n"
        f"for argv in {runs!r}:\n    print('=====', argv[0], flush=True)\n    assert main(argv) == 0\n"
    )
    return ok(
        subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    ).stdout


background.register("evaluation_subcommands", evaluation_subcommands)


def test_evaluation_subcommands_run_from_the_same_yaml(runs):
    validate, test, predict = runs.get("evaluation_subcommands").result().split("=====")[1:]
    assert "val_loss" in validate and "test_loss" in test and predict.startswith(" predict")
