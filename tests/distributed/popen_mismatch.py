"""A user's script run as users run it (``python script.py``: Lightning's popen launcher starts rank 1 as a child of
rank 0, which also hosts the rendezvous store): stage 3, and one rank calls a submodule in ``validation_step``
that the other never calls (sampling on one rank). The submodule is a unit of its own, so its all-gather does not
match the other rank's next one in size and gloo aborts the receiving process in C++.

    python -m tests.distributed.popen_mismatch RANK   # RANK calls the extra submodule
"""

from __future__ import annotations

import sys
import time

import lightning as L
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.demo.data import RandomTokenDataset
from lightning_zero.demo.gpt import GPTLightningModule

SAMPLING_RANK = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0
FAULT_LINE = "[popen_mismatch] the ranks part at "


class SamplesOnOneRank(GPTLightningModule):
    def __init__(self) -> None:
        super().__init__(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
        self.sampler = nn.ModuleList([nn.Linear(32, 32)])  # a stage-3 unit of its own (default units: list items)

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if self.global_rank == SAMPLING_RANK and batch_idx == 0:
            print(f"{FAULT_LINE}{time.time():.3f}", flush=True)  # the tests bound how soon every process ends after it
            self.sampler[0](torch.zeros(1, 32))  # the other rank never gathers this unit
        self.log("val_loss", loss, sync_dist=True)


def main() -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    data = RandomTokenDataset(num_samples=32, block_size=16, vocab_size=32, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=3, timeout=8),
        max_steps=2,
        limit_val_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SamplesOnOneRank(), loader, loader)


if __name__ == "__main__":
    main()
