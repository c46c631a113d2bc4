"""The README's main job, run the way a user runs it (Lightning's popen launcher re-runs the command in each rank):
once, read here for its loss, the lines the README quotes, the
monitor's figures and the checkpoint the README's next steps verify and consolidate; then its Python twin
(``examples/gpt_zero3.py``) and plain LightningCLI syntax."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_zero.cli.estimate import count_model_parameters
from lightning_zero.planning.formulas import CHOICES_BY_NAME, MIB, model_state_split
from tests.integration import background
from tests.launch import REPO
from tests.readme import main_job_command, main_job_quotes, numbers, output_pattern

pytestmark = pytest.mark.slow

#: How the main job is shortened for the tests; `make run` appends the same overrides through RUN_ARGS.
MAIN_JOB_STEPS = 20


@dataclass(frozen=True)
class MainJob:
    stdout: str
    root: Path  # its trainer.default_root_dir (runs/gpt_zero3 in the README)
    steps: int


def run_main_job(root: Path) -> MainJob:
    """The README's main job as a user runs it (Lightning's popen launcher, 2 ranks), ``MAIN_JOB_STEPS`` steps."""
    command = main_job_command(f"trainer.max_steps={MAIN_JOB_STEPS}", f"trainer.default_root_dir={root}")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return MainJob(result.stdout, root, MAIN_JOB_STEPS)


def run_python_twin(root: Path) -> str:
    """``examples/gpt_zero3.py``: the same GPT without YAML, at another stage, in one process (the main job is the
    2-rank run of the same model)."""
    result = subprocess.run(
        [sys.executable, "examples/gpt_zero3.py", "--max-steps", "10", "--stage", "2", "--devices", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


background.register("main_job", run_main_job)
background.register("main_job_in_python", run_python_twin)


@pytest.fixture(scope="module")
def main_job(runs) -> MainJob:
    return runs.get("main_job").result()


def loss_summary(stdout: str) -> tuple[float, float]:
    """LossReport's `loss A -> B` (first step -> mean of the last steps)."""
    found = re.findall(r"^loss (\d+\.\d+) -> (\d+\.\d+)", stdout, flags=re.MULTILINE)
    assert found, stdout[-3000:]
    return tuple(map(float, found[-1]))


def test_the_main_job_trains_and_its_loss_falls(main_job):
    first, last = loss_summary(main_job.stdout)
    assert last < first - 0.5, (first, last)


def test_the_readme_lines_are_what_the_main_job_prints(main_job):
    """The README quotes the 150-step run; this one stops earlier. The lines have the same form, and the losses of
    the first steps are the same (the demo's schedule is a warm-up only: it does not depend on max_steps)."""
    quotes = main_job_quotes()
    lines = main_job.stdout.splitlines()
    summary = [line for line in lines if output_pattern(quotes.summary).fullmatch(line)]
    assert len(summary) == 1, f"README: {quotes.summary!r}; printed: {main_job.stdout[-2000:]}"
    run_first, run_last, _, run_val, run_steps, _ = numbers(summary[0])
    readme_first, readme_last, _, readme_val, _, _ = numbers(quotes.summary)
    assert run_steps == main_job.steps and abs(run_first - readme_first) <= 0.02, (summary[0], quotes.summary)
    assert readme_last < run_last and readme_val < run_val, (summary[0], quotes.summary)  # 150 steps end lower
    step, loss, _ = numbers(quotes.trace)
    traced = [numbers(line) for line in lines if output_pattern(quotes.trace).fullmatch(line)]
    assert [abs(n[1] - loss) <= 0.02 for n in traced if n[0] == step] == [True], (quotes.trace, traced)


def test_the_readme_checkpoint_steps_work_on_what_it_saved(main_job, capsys):
    """`lightning-zero verify runs/gpt_zero3` and `lightning-zero consolidate .../last.ckpt model.pt`, as the README
    has them after `make run` (here with the run's folder in place of runs/gpt_zero3)."""
    from lightning_zero.cli import consolidate_command
    from lightning_zero.cli.verify import main as verify

    root = main_job.root
    capsys.readouterr()
    expected = main_job_quotes().verify.replace("runs/gpt_zero3", str(root)).split()
    expected[2] = str(main_job.steps)
    assert verify([str(root)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == expected
    assert consolidate_command([expected[-1], str(root / "model.pt")]) == 0
    state = torch.load(root / "model.pt", weights_only=True)
    assert state["model.wte.weight"].shape == (34, 128)  # conf/model/gpt_small.yaml: vocab 34, width 128, whole


def test_the_monitor_logs_zero3_state_and_traffic_on_the_formulas(main_job):
    """The ZeroMonitor is on by default: per-rank model state on the ZeRO-3 formula (16P/N, fp32 AdamW) and 3P
    fp32 elements communicated per step, every `log_every_n_steps`, in a first run's version_0."""
    rows = list(csv.DictReader((main_job.root / "logs" / "version_0" / "metrics.csv").read_text().splitlines()))
    logged = [r for r in rows if r.get("monitor/state_MiB_rank0")]
    # log_every_n_steps: 10 (Lightning logs step - 1)
    assert [int(r["step"]) for r in logged] == list(range(9, MAIN_JOB_STEPS, 10))
    params = count_model_parameters(REPO / "conf" / "model" / "gpt_small.yaml")
    expected = sum(model_state_split(CHOICES_BY_NAME["zero3"], params, 2)) / MIB
    for row in logged:
        for rank in (0, 1):
            assert float(row[f"monitor/state_MiB_rank{rank}"]) == pytest.approx(expected, rel=0.05)
        assert float(row["monitor/comm_MiB_per_step"]) == pytest.approx(3 * 4 * params / MIB, rel=0.05)
        assert float(row["monitor/tokens_per_s"]) > 0


def test_the_main_job_in_python_trains(runs):
    first, last = loss_summary(runs.get("main_job_in_python").result())
    assert last < first, (first, last)


@background.in_background
def test_lightning_cli_fit_with_a_registered_strategy_name(tmp_path):
    """`lightning-zero fit` is LightningCLI: any LightningModule and DataModule by class path, `zero3` by name."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_zero",
            "fit",
            "--model",
            "lightning_zero.demo.GPTLightningModule",
            "--model.vocab_size",
            "34",
            "--model.block_size",
            "32",
            "--model.n_layer",
            "2",
            "--model.n_embd",
            "32",
            "--model.n_head",
            "2",
            "--data",
            "lightning_zero.demo.CharDataModule",
            "--data.block_size",
            "32",
            "--data.batch_size",
            "8",
            "--data.num_tokens",
            "20000",
            "--trainer.strategy",
            "zero3",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--trainer.max_steps",
            "5",
            "--trainer.logger",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.limit_val_batches",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=5` reached." in result.stdout + result.stderr
