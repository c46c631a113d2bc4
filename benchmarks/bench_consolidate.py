"""Peak memory of `lightning-zero consolidate` against the model size.

    python benchmarks/bench_consolidate.py

Trains the core benchmark GPT (27M parameters) for one step with ZeroStrategy(stage=2) on 2 CPU ranks,
saves a sharded checkpoint, then consolidates it in a fresh process and prints that process's peak RSS
above its RSS after imports, next to the size of the model and of its largest tensor.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = dict(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512, dropout=0.0)


def train_and_save(directory: Path) -> None:
    import lightning as L

    from lightning_zero import ZeroStrategy
    from lightning_zero.demo import GPTLightningModule, RandomTokenDataModule

    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(
        GPTLightningModule(**MODEL), datamodule=RandomTokenDataModule(vocab_size=8192, block_size=128, batch_size=2)
    )
    trainer.save_checkpoint(directory / "sharded")


def consolidate_and_measure(directory: Path) -> None:
    import torch

    from lightning_zero.checkpoint.consolidate import consolidate

    def rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    before = rss_mb()
    out = consolidate(directory / "sharded", directory / "model.pt")
    peak = rss_mb() - before
    state = torch.load(out, weights_only=True, mmap=True)
    sizes = [t.numel() * t.element_size() / 2**20 for t in state.values()]
    print(json.dumps({"model_mb": sum(sizes), "largest_tensor_mb": max(sizes), "peak_rss_increase_mb": peak}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--train":
        train_and_save(Path(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--consolidate":
        consolidate_and_measure(Path(sys.argv[2]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, __file__, "--train", tmp], check=True, capture_output=True)
            result = subprocess.run(
                [sys.executable, __file__, "--consolidate", tmp], check=True, capture_output=True, text=True
            )
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            print(json.dumps(figures))
            print(
                f"model {figures['model_mb']:.1f} MiB, largest tensor {figures['largest_tensor_mb']:.1f} MiB, "
                f"consolidate peak RSS increase {figures['peak_rss_increase_mb']:.1f} MiB"
            )
