"""The README's main job, run the way a user runs it (Lightning's popen launcher re-runs the script)."""

import re
import subprocess
import sys

import pytest

from tests.launch import REPO

pytestmark = pytest.mark.slow


def test_gpt_zero3_example_trains_and_its_loss_falls():
    result = subprocess.run(
        [sys.executable, "examples/gpt_zero3.py", "--max-steps", "40"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", result.stdout)
    assert summary, result.stdout[-3000:]
    first, last = map(float, summary.groups())
    assert last < first - 0.5, summary.group(0)


def test_lightning_cli_fit_with_a_registered_strategy_name(tmp_path):
    """`lightning-zero fit` is LightningCLI: any LightningModule and DataModule by class path, `zero3` by name."""
    result = subprocess.run(
        [
            sys.executable, "-m", "lightning_zero", "fit",
            "--model", "lightning_zero.demo.GPTLightningModule", "--model.vocab_size", "34",
            "--model.block_size", "32", "--model.n_layer", "2", "--model.n_embd", "32", "--model.n_head", "2",
            "--data", "lightning_zero.demo.CharDataModule", "--data.block_size", "32", "--data.batch_size", "8",
            "--data.num_tokens", "20000", "--trainer.strategy", "zero3", "--trainer.accelerator", "cpu",
            "--trainer.devices", "2", "--trainer.max_steps", "5", "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "2",
            "--trainer.enable_progress_bar", "false", f"--trainer.default_root_dir={tmp_path}",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=5` reached." in result.stdout + result.stderr
