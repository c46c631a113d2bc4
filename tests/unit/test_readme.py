"""Every output and list the README and its docs pages quote, compared in-process with what the code does (issue 36,
items 4, 6-8). Since issue 38 most topics live in docs/*.md; `tests.readme` reads README.md and those pages together.

The README is read, not copied: a changed message or a new strategy file fails here until the README says it.
The main job's own printed lines (loss trace, summary, `verify`) are compared with the README by the test that runs
it anyway, tests/integration/test_examples.py::test_readme_first_command_make_run.
"""

from __future__ import annotations

import configparser
import re
import subprocess

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from tqdm import tqdm

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.cli import main as lightning_zero_command
from lightning_zero.cli.command_line import CommandLine
from lightning_zero.cli.compose import compose
from lightning_zero.cli.schema import LightningSchema
from lightning_zero.config.zero_config import REGISTERED_STRATEGIES
from lightning_zero.demo.callbacks import BAR_FORMAT
from tests.launch import REPO
from tests.readme import find, main_job_command, main_job_quotes, numbers, readme

CONF = REPO / "conf"


def composed(config: str = "gpt_zero3.yaml") -> dict:
    return compose(CommandLine.parse(["fit", "--config", str(CONF / config)]), LightningSchema("fit"))


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


# ------------------------------------------------------------------------------ strategies and config groups


def test_the_config_groups_listed_are_the_files_in_conf():
    listed = find(r"The groups are `strategy` \((.*?)\), `model` \((.*?)\) and `data` \((.*?)\)\.")
    for group, names in zip(("strategy", "model", "data"), map(backticked, listed.groups())):
        assert len(names) == len(set(names)), f"{group} lists a name twice: {names}"
        assert sorted(names) == sorted(p.stem for p in (CONF / group).glob("*.yaml")), group


def test_the_registered_names_are_the_strategy_options_the_readme_says():
    options = backticked(find(r"The groups are `strategy` \((.*?)\)")[1])
    not_registered = backticked(find(r"Each `strategy` option but (.*?) is also a registered name")[1])
    assert set(not_registered) <= set(options)
    assert set(options) - set(not_registered) == set(REGISTERED_STRATEGIES)
    quoted = set(re.findall(r'"(zero\w*)"', readme()))  # `Trainer(strategy="zero2_hsdp")` and the like
    assert quoted and all(StrategyRegistry[name]["strategy"] is ZeroStrategy for name in quoted), quoted


# ------------------------------------------------------------------------------ quoted errors


@pytest.mark.parametrize("label", ["a typo", "a bad value", "an unknown group option"])
def test_the_quoted_command_line_errors_are_what_the_command_prints(label, monkeypatch, capsys):
    """`lightning-zero fit --config conf/gpt_zero3.yaml OVERRIDE`, run in-process from the checkout as a user runs it;
    `...` in a quote stands for a part left out."""
    quote = find(rf"- {label} \(`([^`]+)`\): (`+) ?(.+?) ?\2(?: |$)")
    override, expected = quote[1], quote[3]
    monkeypatch.chdir(REPO)
    assert lightning_zero_command(["fit", "--config", "conf/gpt_zero3.yaml", override]) == 2
    printed = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(re.escape(expected).replace(re.escape("..."), ".*"), printed), printed


# ------------------------------------------------------------------------------ the main job


def test_the_main_job_quotes_agree_with_each_other_and_with_its_config():
    quotes, trainer = main_job_quotes(), composed()["trainer"]
    first, last, tail, val, steps, seconds = numbers(quotes.summary)
    table_steps, table_first, table_last, table_val, table_seconds = numbers(quotes.table)
    assert steps == table_steps == trainer["max_steps"] and tail == 10
    assert (table_first, table_last, table_val) == (first, last, round(val, 2))
    assert abs(table_seconds - seconds) <= 1
    assert numbers(quotes.trace)[0] % trainer["log_every_n_steps"] == 0  # LossReport prints every 10 steps
    assert quotes.verify.split()[:3] == ["complete", "sharded", str(trainer["max_steps"])]


def test_the_main_job_saves_the_checkpoint_the_readme_verifies_and_consolidates():
    config = composed()
    trainer = config["trainer"]
    path = main_job_quotes().verify.split()[-1]
    assert find(r"lightning-zero consolidate (\S+) model\.pt")[1] == path
    saving = [c["init_args"] for c in trainer["callbacks"] if c["class_path"].endswith(".ModelCheckpoint")]
    assert len(saving) == 1 and trainer.get("enable_checkpointing", True)
    assert f"{saving[0]['dirpath']}/last.ckpt" == path and saving[0]["save_last"] is True
    assert saving[0]["every_n_train_steps"] == trainer["max_steps"]
    assert saving[0]["enable_version_counter"] is False  # a rerun keeps the name the README gives
    # sharded: the strategy's default, which the config leaves alone
    assert "state_dict_type" not in trainer["strategy"]["init_args"] and ZeroConfig().state_dict_type == "sharded"


def test_the_progress_bar_the_readme_describes_is_the_one_the_shipped_configs_draw():
    example = find(r"a progress bar counts the optimizer steps \(`([^`]+)`\)")[1]
    shown = tqdm.format_meter(37, 150, 14.0, prefix="step", bar_format=BAR_FORMAT, postfix="epoch=0")
    assert shown.startswith(f"{example} |"), shown
    for config in sorted(p.name for p in CONF.glob("*.yaml")):
        trainer = composed(config)["trainer"]
        # LossReport draws it; Lightning's own bar (`Epoch 0/-2`, `v_num`) stays off
        assert trainer["enable_progress_bar"] is False, config
        assert any(c["class_path"] == "lightning_zero.demo.LossReport" for c in trainer["callbacks"]), config


def test_run_output_is_ignored_by_git_so_a_first_run_is_version_0():
    find(r"The run writes under `runs/gpt_zero3/` \(ignored by git\)")
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    git = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)  # noqa: E731
    assert git("ls-files", "runs").stdout == ""
    assert git("check-ignore", "-q", "runs/gpt_zero3/logs/version_0/metrics.csv").returncode == 0


# ------------------------------------------------------------------------------ installing


def test_the_install_part_pins_torch_as_make_does_and_lists_the_real_extras():
    part = find(r"### Install into your project (.*?) ## Features")[1]
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    extras = set(setup["options.extras_require"])
    pins = set(re.findall(r"torch==([\d.]+)", part))
    assert pins == set(re.findall(r"torch==([\d.]+)", (REPO / "Makefile").read_text()))
    assert torch.__version__.split("+")[0] in pins  # the torch the tests run on
    assert set(re.findall(r"`(\w+)` \(", find(r"Extras: (.*?)\. Then")[1])) == extras
    assert 'pip install -e "' in part and f'"{setup["metadata"]["name"]}[' in part
    assert set(re.findall(r"\[(\w+)\]", part)) <= extras


def test_make_run_is_the_command_the_main_job_tests_run():
    """tests/integration run the main job's command directly (`make run` would reinstall the package inside a test):
    it must be exactly what the Makefile's `run` target runs after its install step."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nrun:", 1)[1].split("\n")[1].strip()
    assert recipe == "$(PYTHON) -m lightning_zero fit --config conf/gpt_zero3.yaml $(RUN_ARGS)"
    assert main_job_command()[1:] == recipe.split()[1:-1]
