"""ZeroMonitor in one process: its cadence under gradient accumulation, switching it off, and the fp16
loss scale of Lightning's own GradScaler, the gradient norm (the multi-rank figures are in tests/integration/test_monitor.py)."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.observability.monitor import ZeroMonitor, count_tokens


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(tmp_path, monitor: ZeroMonitor, **trainer_kwargs) -> list[dict]:
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    logger = CSVLogger(tmp_path)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=logger,
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    monitor.shown = dict(trainer.progress_bar_metrics)  # what a progress bar would show
    path = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    return (
        [r for r in csv.DictReader(path.read_text().splitlines()) if r.get("monitor/state_MiB_rank0")]
        if path.exists()
        else []
    )


def test_one_row_per_logged_optimizer_step_under_accumulation(tmp_path):
    monitor = ZeroMonitor(log_every_n_steps=2)
    rows = fit(tmp_path, monitor, accumulate_grad_batches=3)
    assert [int(r["step"]) for r in rows] == [1, 3, 5]  # optimizer steps 2, 4, 6
    params = 8 * 2 + 2
    # parameters + gradients + AdamW's two moments, fp32 (+ the step counter), on one rank
    assert float(rows[-1]["monitor/state_MiB_rank0"]) * 2**20 == pytest.approx(16 * params + 4, abs=8)
    assert float(rows[-1]["monitor/samples_per_s"]) > 0
    assert {"samples/s", "state_MiB", "comm_MiB"} <= set(monitor.shown)


def test_zero_switches_it_off_and_a_negative_period_is_refused(tmp_path):
    assert fit(tmp_path, ZeroMonitor(log_every_n_steps=0)) == []
    with pytest.raises(ValueError, match="log_every_n_steps=-1"):
        ZeroMonitor(log_every_n_steps=-1)


def test_lightning_fp16_grad_scaler_is_reported(tmp_path):
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    rows = fit(tmp_path, ZeroMonitor(log_every_n_steps=1), plugins=[plugin])
    assert len(rows) == 6 and float(rows[0]["monitor/loss_scale"]) == 1024.0


def test_tokens_are_integer_inputs_and_samples_otherwise():
    assert count_tokens((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))) == (64, "tokens")
    assert count_tokens({"image": torch.zeros(4, 3, 8, 8)}) == (4, "samples")


def test_the_gradient_norm_is_logged_at_the_monitors_cadence_and_a_bad_type_is_refused(tmp_path):
    rows = fit(tmp_path, ZeroMonitor(log_every_n_steps=2, grad_norm_type="inf"), accumulate_grad_batches=3)
    assert [int(r["step"]) for r in rows] == [1, 3, 5] and all(float(r["monitor/grad_inf_norm"]) > 0 for r in rows)
    for bad in (0, -2.0, "two"):
        with pytest.raises(ValueError, match=f"grad_norm_type={bad!r}"):
            ZeroMonitor(grad_norm_type=bad)
