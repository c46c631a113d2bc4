"""Train the character-level GPT as 2 pipeline stages x 2 data-parallel replicas (4 CPU processes), then
evaluate the consolidated weights in one plain process.

    python examples/gpt_pipeline.py                                   # 1F1B, 8 micro-batches, ZeRO-1
    python examples/gpt_pipeline.py --schedule interleaved_1f1b --stage 2 --max-steps 50
    python examples/gpt_pipeline.py --schedule zbv --stage 3 --max-steps 50   # zero bubble, pipeline x ZeRO-3

What makes the GPT pipelineable is ten lines of ``GPTLightningModule`` (lightning_zero/demo/gpt.py)::

    def pipeline_layers(self):                       # the model as a chain of layers
        gpt = self.model
        return [Embeddings(gpt), *gpt.blocks, nn.Sequential(gpt.ln_f, gpt.lm_head)]

    def pipeline_loss(self, logits, targets):        # the loss of the last layer's output
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

Everything else is the ordinary module (its ``training_step`` serves runs without pipelining). Each rank
holds only its stage's layers; the sharded checkpoint holds every parameter under the unsplit model's
names, so ``consolidate`` turns it into a plain ``state_dict`` for ``GPTLightningModule`` in one process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.checkpoint.consolidate import consolidate  # noqa: E402
from lightning_zero.config.zero_config import PIPELINE_SCHEDULES  # noqa: E402
from lightning_zero.demo import CharDataModule, GPTLightningModule, LossReport  # noqa: E402

MODEL = dict(block_size=64, n_layer=4, n_head=4, n_embd=128, learning_rate=2e-3, warmup_steps=10)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4, help="CPU processes: pipeline stages x replicas")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per batch of 16 sequences")
    p.add_argument("--schedule", default="1f1b", choices=PIPELINE_SCHEDULES)
    p.add_argument("--stage", type=int, default=1, choices=(1, 2, 3), help="ZeRO stage across the replicas")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path("runs/gpt_pipeline"))
    return p.parse_args()


def evaluate_alone(weights: Path, data: CharDataModule) -> float:
    """The consolidated weights in a plain GPTLightningModule, one process, no strategy."""
    model = GPTLightningModule(vocab_size=data.vocab_size, **MODEL)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    with torch.no_grad():
        losses = [model._loss(batch) for batch, _ in zip(data.val_dataloader(), range(8))]
    return float(sum(losses) / len(losses))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.devices))
    L.seed_everything(1337, verbose=False)  # the same initial weights on every rank
    data = CharDataModule(block_size=MODEL["block_size"], batch_size=16, num_tokens=200_000, seed=1337)
    model = GPTLightningModule(vocab_size=data.vocab_size, **MODEL)
    strategy = ZeroStrategy(
        stage=args.stage, pipeline_stages=args.stages, microbatches=args.microbatches, pipeline_schedule=args.schedule
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.max_steps,
        limit_val_batches=8,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LossReport(every=10)],
    )
    if trainer.is_global_zero:
        replicas = args.devices // args.stages
        print(
            f"{args.stages} pipeline stages ({args.schedule}, {args.microbatches} micro-batches) x {replicas} "
            f"replica(s), ZeRO-{args.stage}",
            flush=True,
        )
    trainer.fit(model, datamodule=data)
    checkpoint = args.out / "last.ckpt"
    trainer.save_checkpoint(checkpoint, weights_only=False)
    if trainer.is_global_zero:
        print(
            f"rank 0 held {sorted({n.split('.')[1] for n, p in model.named_parameters() if not p.is_meta})} "
            f"of the GPT's {sorted({n.split('.')[1] for n, _ in model.named_parameters()})}"
        )
        weights = consolidate(checkpoint, checkpoint.with_suffix(".pt"))
        print(
            f"single-process val_loss {evaluate_alone(weights, data):.3f} from {weights} "
            f"(pipelined run: {float(trainer.callback_metrics['val_loss']):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
