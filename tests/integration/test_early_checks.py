"""``trainer.fit(ckpt_path=<missing>)`` on 2 processes, run as a user runs it (``python train.py``, ZeroStrategy's
default ``start_method="popen"``): one error from the launching process, before any rank starts. It used to start
both ranks and end seconds later with a traceback from each (issue 78)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration import background

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    if __name__ == "__main__":
        import lightning_zero  # noqa: F401  registers "zero2"

        data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="zero2", max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Regression(), data, ckpt_path="missing.ckpt")
""")


def _missing_checkpoint(root: Path) -> subprocess.CompletedProcess:
    (root / "train.py").write_text(SCRIPT)
    return subprocess.run([sys.executable, "train.py"], cwd=root, capture_output=True, text=True, timeout=300)


background.register("early_checks_missing_checkpoint", _missing_checkpoint)


def test_a_missing_ckpt_path_is_one_error_before_any_rank_starts(runs):
    result = runs.get("early_checks_missing_checkpoint").result()
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert result.stderr.rstrip().splitlines()[-1] == (
        "FileNotFoundError: ckpt_path=missing.ckpt: no such file or directory; give a checkpoint file or sharded "
        "checkpoint directory, or 'last'."
    ), output
    assert output.count("Traceback") == 1, output
    # Lightning's launcher prints these as it starts the ranks and sets up the process group; none ran.
    assert "GLOBAL_RANK" not in output and "Initializing distributed" not in output, output
    assert "[rank" not in output and "distributed_backend" not in output, output
    assert len(output.splitlines()) < 30, output
