"""The run that tests/integration/test_cli.py's command line composes, configured in Python instead.

    python -m tests.integration.cli_python_run OUT_DIR

The CLI, fed conf/gpt_zero3.yaml plus every kind of override, must produce exactly this run.
"""

from __future__ import annotations

import sys

import lightning as L

from lightning_zero import ZeroStrategy
from lightning_zero.demo import CharDataModule, GPTLightningModule
from tests.integration.cli_support import RecordRun


def main(out_dir: str) -> None:
    L.seed_everything(1337, workers=True)
    model = GPTLightningModule(
        vocab_size=34, block_size=16, n_layer=1, n_head=2, n_embd=32, learning_rate=2e-3, build_in_configure_model=True
    )
    data = CharDataModule(block_size=16, batch_size=4, num_tokens=200_000)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, offload_optimizer=True),
        max_steps=4,
        val_check_interval=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        default_root_dir=out_dir,
        logger=False,  # `~trainer.logger`
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[RecordRun(f"{out_dir}/python.pt")],
    )
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main(sys.argv[1])
