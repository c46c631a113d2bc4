"""Fine-tune a locally saved Hugging Face causal LM with ZeRO-3 + bf16-mixed + activation checkpointing,
evaluate it, and export it back to a directory ``from_pretrained`` reads.

    python examples/hf_finetune.py                          # makes a small 'pretrained' Llama first
    python examples/hf_finetune.py --pretrained DIR --max-steps 100
    python examples/hf_finetune.py --strategy zero2_offload --optimizer-state-dtype bf16 --max-steps 300

Nothing is downloaded. Without ``--pretrained`` the script first pretrains a small Llama-style model
(RMSNorm, rotary embeddings, SwiGLU) on one synthetic text for a few steps in one process and saves it with
``save_pretrained``: that directory stands in for a model downloaded from the Hub. The fine-tune then runs on
2 CPU processes on another text:

* ``configure_model`` builds ``AutoModelForCausalLM.from_config(...)`` on the meta device (stage 3), so no rank
  ever holds the whole model;
* ``ZeroStrategy(init_weights=DIR)`` loads the pretrained weights, each rank reading only its own rows;
* ``activation_checkpointing`` recomputes the library's own ``LlamaDecoderLayer`` blocks in backward;
* the sharded checkpoint is exported with ``lightning_zero.checkpoint.consolidate.export_hf`` (the same as
  ``lightning-zero consolidate CKPT OUT --hf``), reloaded with ``from_pretrained`` and evaluated in one process.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

from lightning_zero import ZeroStrategy  # noqa: E402
from lightning_zero.checkpoint.consolidate import export_hf  # noqa: E402
from lightning_zero.config.zero_config import REGISTERED_STRATEGIES  # noqa: E402
from lightning_zero.demo import CharDataModule, LossReport  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrained", help="a save_pretrained directory (default: make one under --out)")
    p.add_argument("--out", default="runs/hf_finetune", help="where the pretrained stand-in, checkpoint and export go")
    p.add_argument("--pretrain-steps", type=int, default=60)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="zero3", choices=sorted(REGISTERED_STRATEGIES), help="a registered name")
    p.add_argument("--optimizer-state-dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--offload-update-interval", type=int, help="selective updates' k (with an offload strategy)")
    p.add_argument("--offload-topk-ratio", type=float, help="selective updates' share of columns on the device")
    p.add_argument("--offload-select-interval", type=int, help="selective updates' steps between choices")
    p.add_argument(
        "--offload-overlap-step", action=argparse.BooleanOptionalAction, help="selective updates' host step overlaps"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gradient-clip-val", type=float, default=None)
    return p.parse_args()


class CausalLM(L.LightningModule):
    """Any causal LM from a Hugging Face config, built where the strategy says (meta device under stage 3)."""

    def __init__(self, pretrained: str, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hparams.pretrained))

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch  # (B, T) tokens and next tokens
        logits = self.model(input_ids=x).logits  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)


def make_pretrained(directory: Path, vocab_size: int, steps: int) -> None:
    """A few steps of plain single-process training on one synthetic text, saved with save_pretrained."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    data = CharDataModule(block_size=64, batch_size=16, num_tokens=50_000, seed=1)
    data.setup()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, (x, y) in zip(range(steps), data.train_dataloader()):
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"pretrained stand-in: {steps} steps, loss {loss.item():.2f}; saved to {directory}", flush=True)
    model.save_pretrained(directory)


def evaluate(model, data: CharDataModule) -> float:
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten()).item()
            for x, y in data.val_dataloader()
        ]
    return sum(losses) / len(losses)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.devices))
    out = Path(args.out)
    data = CharDataModule(block_size=64, batch_size=8, num_tokens=60_000, seed=2)  # another text than pretraining
    pretrained = Path(args.pretrained) if args.pretrained else out / "pretrained"
    # Lightning starts the other ranks by re-running this script: only the first process prepares the model.
    if not (pretrained / "config.json").exists() and "LOCAL_RANK" not in os.environ:
        make_pretrained(pretrained, data.vocab_size, args.pretrain_steps)

    L.seed_everything(1337, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ZeroStrategy(
            **{
                **REGISTERED_STRATEGIES[args.strategy],
                **{
                    name: getattr(args, name)
                    for name in (
                        "offload_update_interval",
                        "offload_topk_ratio",
                        "offload_select_interval",
                        "offload_overlap_step",
                    )
                    if getattr(args, name) is not None
                },
            },
            optimizer_state_dtype=args.optimizer_state_dtype,
            init_weights=str(pretrained),
            activation_checkpointing=LlamaDecoderLayer,
        ),
        precision="bf16-mixed",
        max_steps=args.max_steps,
        gradient_clip_val=args.gradient_clip_val,
        limit_val_batches=8,
        val_check_interval=args.max_steps,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LossReport(every=10)],
    )
    module = CausalLM(str(pretrained), lr=args.lr)
    before = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    trainer.fit(module, datamodule=data)
    after = trainer.callback_metrics["val_loss"].item()
    checkpoint = out / "finetuned"
    trainer.save_checkpoint(checkpoint)
    if trainer.is_global_zero:
        exported = export_hf(checkpoint, out / "exported")
        model = AutoModelForCausalLM.from_pretrained(exported)
        data.setup()
        reloaded = evaluate(model, data)
        print(
            f"val_loss: pretrained {before:.3f} -> fine-tuned {after:.3f} (uniform guess {math.log(data.vocab_size):.3f})"
        )
        print(f"exported to {exported}; from_pretrained on one process: val_loss {reloaded:.3f}")


if __name__ == "__main__":
    main()
