"""LossReport in one process: the trace and `loss A -> B` lines the examples' tests read, and the progress bar it
draws on a terminal only (issue 36, item 7: no bar in CI logs; on a terminal `step n/max_steps`, not Lightning's
`Epoch 0/-2`, and no `v_num`)."""

from __future__ import annotations

import io
import re
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.demo import LossReport
from lightning_zero.demo.callbacks import short_number


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Terminal(io.StringIO):
    """What `sys.stdout` is in an interactive shell, as far as `isatty()` tells."""

    def isatty(self) -> bool:
        return True


def fit(tmp_path, report: LossReport, *, max_steps: int = 12, **trainer_kwargs) -> L.Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 8), torch.randint(0, 2, (40,)))  # 5 batches an epoch: several epochs
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=CSVLogger(tmp_path),
        callbacks=[report],
        enable_checkpointing=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    return trainer


def test_not_a_terminal_prints_the_trace_and_summary_only(tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    fit(tmp_path, LossReport(every=5), enable_progress_bar=False)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and not any("|" in line for line in lines)
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1", "5", "10"]
    assert re.fullmatch(r"loss \d\.\d\d -> \d\.\d\d \(first step -> mean of last 10; 12 steps in \d+\.\ds\)", lines[-1])


def test_a_terminal_gets_a_bar_of_optimizer_steps_without_v_num(tmp_path, monkeypatch):
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    fit(tmp_path, LossReport(every=5), enable_progress_bar=False)
    text = out.getvalue()
    final = text.split("\r")[-1].splitlines()[0]  # the bar as it was left, above the summary line
    assert re.match(r"step 12/12 \|[█#]+\| 100% \[", final), final  # ASCII blocks when the stream has no encoding
    assert "epoch=2" in final and "train_loss=" in final
    assert "v_num" not in text and "Epoch" not in text and "/-2" not in text
    # the trace lines are written above the bar (tqdm clears its line first), whole
    segments = [s.strip() for s in re.split(r"[\r\n]", text)]
    assert sum(bool(re.fullmatch(r"step +(1|5|10)  loss \d\.\d{3}  \(\d+\.\ds\)", s)) for s in segments) == 3, text
    assert text.rstrip().splitlines()[-1].startswith("loss ")


@pytest.mark.parametrize(("progress_bar", "lightning_bar"), [(False, False), (None, True)])
def test_no_bar_when_switched_off_or_when_the_trainer_draws_its_own(tmp_path, monkeypatch, progress_bar, lightning_bar):
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    trainer = fit(tmp_path, LossReport(progress_bar=progress_bar), max_steps=3, enable_progress_bar=lightning_bar)
    assert "step 3/3" not in out.getvalue()
    assert (trainer.progress_bar_callback is not None) == lightning_bar


def test_bar_figures_are_short_and_whole_when_large():
    assert [short_number(v) for v in (4730.4, 2.13046, 0.000123, 12)] == ["4730", "2.13", "0.000123", "12"]
