"""A small nanoGPT-style GPT and a LightningModule that trains it.

The model exists to exercise the ZeRO strategy, so it is written with sharding in
mind rather than squeezing out the last bit of quality:

* every parameter belongs to a stock ``nn.Linear`` / ``nn.Embedding`` /
  ``nn.LayerNorm`` and is initialised by that module's ``reset_parameters()``.
  There is deliberately no ``apply(_init_weights)`` pass, so the model can be
  built on the meta device and materialised module by module (``to_empty`` +
  ``reset_parameters``), which is what sharding strategies do;
* the transformer layers live in an ``nn.ModuleList`` called ``blocks`` so a
  strategy (or FSDP2's ``fully_shard``) can treat each ``Block`` as a unit;
* weight tying is off by default. A tied embedding/unembedding is one tensor
  used by two modules, which complicates per-module sharding and meta-device
  materialisation. When enabled it is implemented without sharing a Parameter
  between modules (see :meth:`GPT.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, cast

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities import AttributeDict

from lightning_zero.sequence_parallel import positions, sequence_length


@dataclass
class GPTConfig:
    """Architecture hyperparameters (defaults: a tiny, CPU-friendly model)."""

    vocab_size: int = 256
    block_size: int = 128  # maximum context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # bias in Linear layers and LayerNorms
    tie_weights: bool = False  # share the token embedding with the output projection

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # q, k, v projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads: (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with the usual 4x expansion."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """One pre-LayerNorm transformer layer: the natural unit for ZeRO-3/FSDP sharding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """Decoder-only transformer: embeddings -> ``blocks`` -> LayerNorm -> logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embeddings
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # With tying, the output projection *is* wte.weight and there is no lm_head module,
        # so no Parameter is shared between two modules (which would break under
        # per-module to_empty()/sharding). Without tying it is an ordinary Linear.
        self.lm_head = None if config.tie_weights else nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(B, T)`` to next-token logits ``(B, T, vocab_size)``."""
        B, T = idx.shape
        if (length := sequence_length(T)) > self.config.block_size:  # the whole sequence's, under sequence parallelism
            raise ValueError(f"sequence length {length} exceeds block_size {self.config.block_size}")
        pos = positions(T, device=idx.device)  # (T,): this rank's part of the sequence under sequence parallelism
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        if self.lm_head is None:
            # nn.Embedding initialises N(0, 1) (nanoGPT's custom init would use 0.02), so an
            # unscaled tied head would start with logits of std ~sqrt(C) and a huge loss.
            # Scaling by 1/sqrt(C) restores unit-scale logits without a custom init.
            return F.linear(x, self.wte.weight) * self.config.n_embd**-0.5  # (B, T, V)
        return self.lm_head(x)  # (B, T, V)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class Embeddings(nn.Module):
    """Token and position embeddings as one pipeline layer, ``(B, T)`` ids -> ``(B, T, C)``. It holds the GPT's own
    ``wte``/``wpe`` modules (not copies), so their parameters keep the GPT's names."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = positions(idx.shape[1], device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


def count_parameters(config: GPTConfig) -> int:
    """Exact parameter count of ``GPT(config)``, computed without allocating weights.

    Building on the meta device costs nothing and cannot drift from the real
    architecture the way a hand-written formula can.
    """
    with torch.device("meta"):
        return GPT(config).num_parameters()


def _linear_warmup(step: int, warmup_steps: int) -> float:
    """LR multiplier: ramps linearly from 1/warmup_steps to 1, then stays at 1."""
    return min(1.0, (step + 1) / warmup_steps)


class GPTLightningModule(L.LightningModule):
    """Trains :class:`GPT` with next-token cross-entropy and AdamW.

    Args:
        vocab_size ... tie_weights: forwarded to :class:`GPTConfig`.
        learning_rate, weight_decay, betas: AdamW settings (nanoGPT defaults).
        warmup_steps: if > 0, linear LR warmup over this many optimizer steps.
        build_in_configure_model: if True the GPT is not built in ``__init__`` but in
            :meth:`configure_model`, which Lightning calls inside the strategy's
            init contexts. That lets a sharding strategy build it on the meta device
            (or directly sharded) instead of materialising the full model per rank.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(**{f.name: self.hparams[f.name] for f in fields(GPTConfig)})
        self.model: GPT | None = None if build_in_configure_model else GPT(self.config)

    def configure_model(self) -> None:
        # Lightning may call this hook more than once (e.g. fit then validate), so only build once.
        if self.model is None:
            self.model = GPT(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError("The GPT is built in configure_model() (build_in_configure_model=True); call it first.")
        return self.model(idx)  # (B, T, V)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        return self.pipeline_loss(self(x), y)

    # Pipeline stages (ZeroStrategy(pipeline_stages=p)): the model as a chain of layers, and the loss of its output.
    def pipeline_layers(self) -> list[nn.Module]:
        """Embeddings, each block, then the final LayerNorm and head: ``n_layer + 2`` layers to cut into stages."""
        gpt = self.model
        if gpt is None or gpt.lm_head is None:
            raise ValueError(
                "The GPT pipelines once built and with `tie_weights=False` (a tied head spans two stages)."
            )
        return [Embeddings(gpt), *gpt.blocks, nn.Sequential(gpt.ln_f, gpt.lm_head)]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))  # (B*T, V) vs (B*T,)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The most likely next token at every position, ``(B, T)``."""
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> Any:
        """AdamW with nanoGPT's split: weight decay on matrices (dim >= 2), none on
        biases and LayerNorm gains (dim < 2).

        Two param groups also give a ZeRO implementation a realistic case to handle
        (per-group hyperparameters must survive flattening/partitioning).
        """
        hp = cast(AttributeDict, self.hparams)
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
        if hp.warmup_steps <= 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(_linear_warmup, warmup_steps=hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
