"""Architectures that feed normalization layers and residual streams in other dtypes than the demos do.

Every model here trains under Lightning's ``ddp`` with ``bf16-mixed``; under ZeroStrategy they once
crashed with ``mixed dtype (CPU): expect parameter to have scalar type of Float`` (a 2-byte norm weight met an
fp32 input). Each ``training_step`` returns a loss against fp32 targets.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

DIM = 32


class PreNormBlock(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``: the first block's norm sees the raw (fp32, fp16 or bf16) features."""

    def __init__(self, dim: int = DIM, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class UpcastBlock(nn.Module):
    """Normalizes in fp32 itself (``.float()``), scales by a learned gain, and casts back to its input's dtype."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.gain = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        h = self.norm(x.float()) * self.gain
        return x + self.proj(F.silu(h)).to(x.dtype)


class RoutedBlock(nn.Module):
    """A router that casts its own classifier to the dtype it declares in every forward, as Hugging Face's Switch
    Transformers and NLLB-MoE routers do (``self.classifier = self.classifier.to(self.dtype)``), choosing between
    two experts per token."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = Router(dim, 2)
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])

    def forward(self, x):
        h = self.norm(x)
        probs = self.router(h)
        out = torch.stack([expert(h) for expert in self.experts], dim=-1)
        return x + (out * probs.unsqueeze(-2).to(out.dtype)).sum(-1)


class ReparametrizedBlock(nn.Module):
    """Weights computed from other parameters before each use: ``parametrizations.spectral_norm`` (a power iteration
    against fp32 buffers), ``parametrizations.weight_norm`` and the older hook-based ``torch.nn.utils.weight_norm``
    (Wav2Vec2's positional convolution, vocoders, GAN discriminators)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.spectral = nn.utils.parametrizations.spectral_norm(nn.Linear(dim, dim))
        self.weight_normed = nn.utils.parametrizations.weight_norm(nn.Linear(dim, dim))
        self.hooked = nn.utils.weight_norm(nn.Linear(dim, dim))

    def forward(self, x):
        h = F.gelu(self.spectral(self.norm(x)))
        return x + self.hooked(F.gelu(self.weight_normed(h)))


class Router(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(dim, experts, bias=False)
        self.dtype = torch.float32

    def forward(self, x):
        x = x.to(self.dtype)
        self.classifier = self.classifier.to(self.dtype)
        return torch.softmax(self.classifier(x), dim=-1, dtype=self.dtype)


class FeatureModel(L.LightningModule):
    """Tabular/vector features -> blocks -> a regression head, MSE against fp32 targets."""

    def __init__(self, block: type[nn.Module], input_dtype: torch.dtype = torch.float32, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(depth)])
        self.head = nn.Linear(DIM, 2)
        self.input_dtype = input_dtype

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = x.to(self.input_dtype)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.head(h).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class ConvGroupNormModel(L.LightningModule):
    """Conv -> GroupNorm -> ReLU twice, pooled, classified (cross entropy)."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(c_in, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU()) for c_in in (4, 16)]
        )
        self.head = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = x.view(-1, 4, 4, 8)
        for stage in self.stages:
            h = stage(h)
        return F.cross_entropy(self.head(h.mean(dim=(2, 3))), y[:, 0].long().abs() % 4)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class TokenBlock(nn.Module):
    """LayerNorm -> Linear -> RMSNorm, and a GroupNorm over channels, on a residual stream."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.rms = nn.RMSNorm(DIM)
        self.gn = nn.GroupNorm(4, DIM)

    def forward(self, x):  # x: (B, T, C)
        x = x + self.rms(self.fc(self.ln(x)))
        return x + self.gn(x.transpose(1, 2)).transpose(1, 2)


class TokenModel(L.LightningModule):
    """``nn.Embedding`` plus fixed fp32 sinusoidal positions (a residual stream mixing dtypes), then blocks."""

    def __init__(self, vocab: int = 16, length: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList([TokenBlock() for _ in range(2)])
        self.head = nn.Linear(DIM, vocab)
        position = torch.arange(length).unsqueeze(1) * torch.exp(torch.arange(0, DIM, 2) * (-math.log(1e4) / DIM))
        self.register_buffer(
            "positions", torch.cat([torch.sin(position), torch.cos(position)], dim=1), persistent=False
        )
        self.vocab = vocab

    def training_step(self, batch, batch_idx):
        x, _ = batch
        tokens = (x[:, :8].abs() * 5).long() % self.vocab
        h = self.embed(tokens) + self.positions
        for block in self.blocks:
            h = block(h)
        logits = self.head(h[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


#: name -> a factory of the LightningModule.
ZOO = {
    "prenorm_mlp": lambda: FeatureModel(PreNormBlock),
    "prenorm_mlp_fp16_inputs": lambda: FeatureModel(PreNormBlock, input_dtype=torch.float16),
    "prenorm_mlp_bf16_inputs": lambda: FeatureModel(PreNormBlock, input_dtype=torch.bfloat16),
    "upcasting": lambda: FeatureModel(UpcastBlock),
    "self_casting_router": lambda: FeatureModel(RoutedBlock),
    "reparametrized": lambda: FeatureModel(ReparametrizedBlock),
    "conv_groupnorm": ConvGroupNormModel,
    "embedding_norms": TokenModel,
}


class Features(Dataset):
    """128-wide fp32 features (viewed as images by the conv model) and fp32 targets."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 128, generator=g)
        self.y = torch.randn(n, 2, generator=g) * 2

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        return (x[:DIM] if x.shape[0] != DIM else x), self.y[i]


class ImageFeatures(Features):
    def __getitem__(self, i):
        return self.x[i], self.y[i]


def data_for(name: str, batch: int = 4) -> DataLoader:
    dataset = ImageFeatures() if name in ("conv_groupnorm", "embedding_norms") else Features()
    return DataLoader(dataset, batch_size=batch, shuffle=False)
