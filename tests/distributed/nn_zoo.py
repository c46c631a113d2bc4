"""Architectures built from ``torch.nn``'s own layers rather than Hugging Face's, each with the trap it carries,
trained as next-token models on token windows: the breadth check of stages 1-3 beside ``hf_zoo.py``.

Recurrent layers (``nn.LSTM``, bidirectional and with ``proj_size``, ``nn.GRU``, ``nn.RNN`` and an ``nn.LSTMCell``
stepped in Python: weights the kernels read through ``_flat_weights``, which must follow every swap of the
parameters), ``nn.MultiheadAttention`` (one packed ``in_proj_weight``, an ``out_proj`` whose weight the functional
call reads without calling the module, separate q/k/v weights when ``kdim``/``vdim`` differ, a learned memory at the
root), ``nn.TransformerEncoder`` (pre-norm, causal, with a final norm) and ``nn.Transformer`` (encoder-decoder), and
reparametrized weights (``parametrizations.weight_norm``/``spectral_norm``/``orthogonal`` and the older hook-based
``weight_norm``/``spectral_norm``: the layer's weight is computed from other parameters, and buffers are updated,
in every forward).

Attention gives its key biases a gradient of rounding noise (softmax is blind to them) in the order each run sums
it; AdamW steps that noise at full size with its default ``eps``, so these models use ``eps=1e-6`` (as
``hf_models.py``'s CLIP does).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

VOCAB, LENGTH, WIDTH = 32, 12, 16
KINDS = ("lstm", "recurrent_cells", "attention", "transformer_encoder", "transformer", "reparametrized")


class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.LSTM(WIDTH, WIDTH, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * WIDTH, VOCAB)

    def forward(self, x):
        return self.head(self.rnn(self.embed(x))[0])


class RecurrentCells(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.gru = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.projected = nn.LSTM(WIDTH, WIDTH, proj_size=8, batch_first=True)
        self.rnn = nn.RNN(8, WIDTH, batch_first=True, nonlinearity="relu")
        self.cell = nn.LSTMCell(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.rnn(self.projected(self.gru(self.embed(x))[0])[0])[0]
        hx = cx = h.new_zeros(x.shape[0], WIDTH)
        outs = []
        for t in range(h.shape[1]):
            hx, cx = self.cell(h[:, t], (hx, cx))
            outs.append(hx)
        return self.head(torch.stack(outs, dim=1))


class AttentionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.MultiheadAttention(WIDTH, 2, batch_first=True) for _ in range(2))
        self.cross = nn.MultiheadAttention(WIDTH, 2, kdim=8, vdim=8, batch_first=True)
        self.memory = nn.Parameter(torch.randn(1, 4, 8))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h, h, h, need_weights=False)[0]
        memory = self.memory.expand(x.shape[0], -1, -1)
        return self.head(h + self.cross(h, memory, memory)[0])


class TransformerEncoderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(WIDTH), enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.encoder(self.embed(x), mask=mask, is_causal=True))


class TransformerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(WIDTH, 2, 2, 1, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.head(self.transformer(self.embed(x.flip(1)), self.embed(x)))


class ReparametrizedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.conv = parametrizations.weight_norm(nn.Conv1d(WIDTH, WIDTH, 5, padding=2, groups=4), dim=2)
        self.hooked_conv = nn.utils.weight_norm(nn.Conv1d(WIDTH, WIDTH, 3, padding=1))
        self.up = nn.ConvTranspose1d(WIDTH, WIDTH, 3, padding=1)
        self.norm = nn.GroupNorm(4, WIDTH)
        self.act = nn.PReLU(WIDTH)
        self.spectral = parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH))
        self.hooked_spectral = nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH))
        self.orthogonal = parametrizations.orthogonal(nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.embed(x).transpose(1, 2)
        h = self.act(self.norm(self.up(torch.tanh(self.hooked_conv(self.conv(h)))))).transpose(1, 2)
        return self.head(self.orthogonal(torch.tanh(self.hooked_spectral(self.spectral(h)))))


BUILDERS = {
    "lstm": LSTMModel,
    "recurrent_cells": RecurrentCells,
    "attention": AttentionModel,
    "transformer_encoder": TransformerEncoderModel,
    "transformer": TransformerModel,
    "reparametrized": ReparametrizedModel,
}
#: What a user lists for activation checkpointing in each model.
CHECKPOINTED = {
    "lstm": nn.LSTM,
    "recurrent_cells": nn.LSTM,
    "attention": nn.MultiheadAttention,
    "transformer_encoder": nn.TransformerEncoderLayer,
    "transformer": nn.TransformerDecoderLayer,
    "reparametrized": nn.Conv1d,
}


class NnZooModule(L.LightningModule):
    """Next-token cross entropy (each position predicts the token before it); AdamW over 2 param groups."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.model = kind, BUILDERS[kind]()

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = F.cross_entropy(self.model(x).flatten(0, 1), x.roll(1, 1).flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=3e-3, eps=1e-6)


def tokens() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (16, LENGTH), generator=torch.Generator().manual_seed(3))
    )
