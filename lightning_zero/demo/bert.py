"""A small BERT-style masked-language model over the character corpus.

BERT's recipe at toy scale: a bidirectional transformer encoder (``nn.TransformerEncoder``, pre-LayerNorm),
15% of positions chosen per sequence, 80% of those replaced by ``[MASK]``, 10% by a random token, 10% kept,
and the loss taken on the chosen positions only. Masking draws from the global torch RNG, which checkpoints
of this package save and restore per rank, so a resumed run masks exactly as an uninterrupted one would.

The module keeps a little user state beyond its weights (samples seen, best validation loss) in every
checkpoint through ``on_save_checkpoint`` / ``on_load_checkpoint``, as real training code does.
"""

from __future__ import annotations

import math
from typing import Any, cast

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities import AttributeDict


class MaskedLM(nn.Module):
    """Token + position embeddings -> encoder layers -> LayerNorm -> logits over the vocabulary."""

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size + 1, n_embd)  # + [MASK]
        self.pos = nn.Embedding(block_size, n_embd)
        layer = nn.TransformerEncoderLayer(
            n_embd, n_head, 4 * n_embd, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(positions)  # (B, T, C)
        return self.head(self.ln_f(self.encoder(x)))  # (B, T, V)


class MaskedLMLightningModule(L.LightningModule):
    """Trains :class:`MaskedLM` with BERT's masking; logs ``train_loss`` / ``val_loss`` on masked positions.

    Args:
        vocab_size: tokens of the data (``[MASK]`` is added as id ``vocab_size``).
        mask_prob: fraction of positions the loss is taken on (BERT: 0.15).
        learning_rate, weight_decay, warmup_steps: AdamW with linear warmup.
    """

    def __init__(
        self,
        vocab_size: int = 34,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        mask_prob: float = 0.15,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = MaskedLM(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        #: user state carried by checkpoints (see on_save_checkpoint)
        self.samples_seen = 0
        self.best_val_loss = math.inf
        self.resumed_at_samples: int | None = None

    def mask(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels): BERT's 80/10/10 corruption; labels are -100 where no loss is taken."""
        hp = cast(AttributeDict, self.hparams)
        chosen = torch.rand(tokens.shape, device=tokens.device) < hp.mask_prob
        chosen[:, 0] |= ~chosen.any(dim=1)  # at least one position per sequence
        action = torch.rand(tokens.shape, device=tokens.device)
        inputs = tokens.clone()
        inputs[chosen & (action < 0.8)] = hp.vocab_size  # [MASK]
        randomized = chosen & (action >= 0.8) & (action < 0.9)
        inputs[randomized] = torch.randint(0, hp.vocab_size, (int(randomized.sum()),), device=tokens.device)
        return inputs, torch.where(chosen, tokens, torch.full_like(tokens, -100))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, labels = self.mask(batch[0])
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)

    def on_train_start(self) -> None:
        if self.resumed_at_samples is not None and self.trainer.is_global_zero:
            print(
                f"resumed at step {self.trainer.global_step}: {self.samples_seen} samples seen, "
                f"best val_loss {self.best_val_loss:.3f}",
                flush=True,
            )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.samples_seen += batch[0].size(0) * self.trainer.world_size
        self.log("train_loss", loss, prog_bar=True)
        self.log("samples_seen", float(self.samples_seen))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        val = self.trainer.callback_metrics.get("val_loss")
        if val is not None and not self.trainer.sanity_checking:
            self.best_val_loss = min(self.best_val_loss, float(val))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["masked_lm"] = {"samples_seen": self.samples_seen, "best_val_loss": self.best_val_loss}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["masked_lm"]
        self.samples_seen, self.best_val_loss = state["samples_seen"], state["best_val_loss"]
        self.resumed_at_samples = self.samples_seen

    def configure_optimizers(self) -> Any:
        hp = cast(AttributeDict, self.hparams)
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
        )
        if hp.warmup_steps <= 0:
            return optimizer
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}
