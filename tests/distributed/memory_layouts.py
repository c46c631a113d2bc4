"""Models that train under Lightning ``ddp`` as built and once tripped ZeroStrategy: parameters or gradients that are
not dense row-major tensors of one dtype (see [Note: the memory the row shards need] in
``lightning_zero/engine/row_major.py``), 0-dim parameters, a block run several times a forward, layers run
other than through ``__call__``, parameters written in place between steps, integer parameters. Under ZeroStrategy
each must train to ``ddp``'s weights."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.distributed import models


class ChannelsLastNet(L.LightningModule):
    """A small CNN moved to ``torch.channels_last`` with its inputs, as vision training scripts do (convolutions
    without biases before BatchNorm, as in ResNets: such a bias gets a gradient of rounding noise only)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 2),
        ).to(memory_format=torch.channels_last)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x.contiguous(memory_format=torch.channels_last)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return models.loader(
            TensorDataset(torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 2, (32,), generator=g)), 4
        )


class RegressionTask(L.LightningModule):
    """AdamW with weight decay on 32 samples of 8 features and one target, batches of 4: what the models below share."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return models.loader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)), 4)


class TransposedWeight(RegressionTask):
    """A parameter made from a transposed tensor keeps its column-major strides."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 8).t())
        self.head = nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(x @ self.weight)), y)


class TwoDtypes(RegressionTask):
    """A body and a head built in different dtypes (``head_dtype``, ``body_dtype``) under ``precision="32-true"``: a
    float64 head on a float32 body, or a bfloat16 body under a float32 head (as layers loaded in bf16 next to
    layers kept in fp32)."""

    def __init__(self, body_dtype: torch.dtype, head_dtype: torch.dtype) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16).to(body_dtype)
        self.head = nn.Linear(16, 1).to(head_dtype)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.body(x.to(self.body.weight.dtype)))
        return F.mse_loss(self.head(h.to(self.head.weight.dtype)).float(), y)


class SparseEmbeddings(L.LightningModule):
    """``nn.Embedding`` and ``nn.EmbeddingBag`` with ``sparse=True``, stepped by an optimizer that takes sparse
    gradients (``optimizer``: ``"sgd"`` or ``"adagrad"``); each batch reaches a few of the table's rows."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer = optimizer
        self.tokens = nn.Embedding(40, 8, sparse=True)
        self.bags = nn.EmbeddingBag(40, 8, mode="mean", sparse=True)
        self.head = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.tokens(ids).mean(1), self.bags(ids)], dim=1))

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return F.mse_loss(self(ids), y)

    def configure_optimizers(self):
        if self.optimizer == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return models.loader(
            TensorDataset(torch.randint(0, 40, (32, 3), generator=g), torch.randn(32, 1, generator=g)), 4
        )


class SparseLookup(nn.Module):
    """A table looked up with ``F.embedding(..., sparse=True)``: a sparse gradient no layer flag makes."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, sparse=True)


class FunctionalSparse(SparseEmbeddings):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = SparseLookup(40, 8)


class CastsItself(nn.Module):
    """A gate that casts its own Linear to fp32 in forward without saying so (no ``self.dtype``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        self.proj = self.proj.float()
        return torch.sigmoid(self.proj(x.float()))


class UndeclaredCast(RegressionTask):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.gate = CastsItself()
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        return F.mse_loss(self.head(h * self.gate(h).to(h.dtype)).float(), y)


class SharedBlock(RegressionTask):
    """One block applied three times (weights shared across depth, as ALBERT does): at stage 3 the block's unit runs
    three times a forward and is reduced three times a backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        for _ in range(3):
            h = h + self.block(h)
        return F.mse_loss(self.head(h), y)


class GatedResidual(nn.Module):
    """A block with layers of its own and a parameter of its own (the gain)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 16)
        self.gain = nn.Parameter(torch.full((16,), 0.5))

    def forward(self, h):
        return h + self.gain * torch.tanh(self.proj(self.norm(h)))


class DirectForwardBlocks(RegressionTask):
    """Blocks run as ``block.forward(h)``, as SqueezeBERT's encoder runs its layers: the call skips the forward hooks
    in which FSDP2 gathers a stage-3 unit and activation checkpointing acts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(GatedResidual() for _ in range(2))
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block.forward(h)
        return F.mse_loss(self.head(h), y)


class NamedBlocks(nn.Module):
    """Blocks held as numbered attributes and run as ``getattr(self, f"block_{i}").forward(h)``."""

    def __init__(self) -> None:
        super().__init__()
        self.block_0, self.block_1 = GatedResidual(), GatedResidual()

    def forward(self, h):
        for i in range(2):
            h = getattr(self, f"block_{i}").forward(h)
        return h


class Stack(nn.Module):
    """A list of blocks whose holder never runs it: the training step reaches into it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GatedResidual() for _ in range(2))


class AliasedForwardBlocks(RegressionTask):
    """Blocks run as ``layer.forward(h)`` after ``layer = self.stack.layers[i]`` (two levels down, through a local
    name), beside numbered blocks a child runs through ``getattr``: what the source reading follows to the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.named, self.stack, self.head = nn.Linear(8, 16), NamedBlocks(), Stack(), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.named(self.embed(x))
        for i in range(len(self.stack.layers)):
            layer = self.stack.layers[i]
            h = layer.forward(h)
        return F.mse_loss(self.head(h), y)


class TiedHeadReadDirectly(RegressionTask):
    """A head that computes with the embedding's own weight (``F.linear(h, self.embed.weight)``, as weight-tied
    language models write it) and no list of blocks, so by default each child holding parameters would be a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rnn, self.norm = nn.Linear(8, 16), nn.GRU(16, 16, batch_first=True), nn.LayerNorm(16)
        self.out = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h, _ = self.rnn(self.embed(x).unsqueeze(1))
        tied = F.linear(self.norm(h.squeeze(1)), self.embed.weight.t())  # the embedding's transpose decodes
        return F.mse_loss(self.out(tied), y)


class Attention(RegressionTask):
    """``nn.MultiheadAttention`` blocks, whose forward hands ``self.out_proj.weight`` to the functional attention
    without calling ``out_proj``: a ``wrap_policy`` naming ``nn.Linear`` must not make ``out_proj`` a unit (FSDP1's
    size-based policy keeps the attention whole for the same reason). AdamW's ``eps`` is 1e-6: the key biases'
    gradient is rounding noise (softmax is blind to them) that the default ``eps`` would step at full size."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
        self.blocks = nn.ModuleList(nn.MultiheadAttention(8, 2, batch_first=True) for _ in range(2))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1, eps=1e-6)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x).view(-1, 2, 8)
        for block in self.blocks:
            h = h + block(h, h, h, need_weights=False)[0]
        return F.mse_loss(self.head(h.flatten(1)), y)


class AutoEncoder(nn.Module):
    """Run through its methods, never its forward; a gain of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 4), nn.Linear(4, 8)
        self.gain = nn.Parameter(torch.ones(4))

    def encode(self, x):
        return torch.tanh(self.enc(x)) * self.gain

    def decode(self, z):
        return self.dec(z)


class Reconstruction(RegressionTask):
    """An autoencoder's ``encode`` and ``decode`` called in ``training_step``, a head on its code: no list of blocks,
    so by default each child holding parameters is a stage-3 unit."""

    def __init__(self) -> None:
        super().__init__()
        self.vae, self.head = AutoEncoder(), nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        z = self.vae.encode(x)
        return F.mse_loss(self.vae.decode(z), x) + F.mse_loss(self.head(z), y)


class Temperature(RegressionTask):
    """A learned 0-dim temperature (CLIP's ``logit_scale``) beside a frozen 0-dim constant: FSDP2 refuses to shard
    either (see [Note: 0-dim parameters at stage 3] in ``lightning_zero/engine/stage3/fsdp2_zero_dim_params.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))
        self.shift = nn.Parameter(torch.tensor(0.1), requires_grad=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(self.body(x))) * self.logit_scale.exp() + self.shift, y)


class QuantizedLinear(nn.Module):
    """A frozen int8 weight with its fp32 scales and bias in one layer, and a trainable low-rank adapter (QLoRA)."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.qweight = nn.Parameter(torch.empty(fan_out, fan_in, dtype=torch.int8), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(fan_out), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(fan_out), requires_grad=False)
        self.lora_a = nn.Parameter(torch.empty(4, fan_in))
        self.lora_b = nn.Parameter(torch.empty(fan_out, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            weight = torch.randn(self.qweight.shape)
            self.scale.copy_(weight.abs().amax(1) / 127)
            self.qweight.copy_((weight / self.scale[:, None]).round())
            self.bias.zero_()
            self.lora_a.normal_(std=0.1)
            self.lora_b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            F.linear(x, self.qweight.to(x.dtype) * self.scale[:, None], self.bias)
            + x @ self.lora_a.t() @ self.lora_b.t()
        )


class QuantizedBase(RegressionTask):
    """Integer parameters, which FSDP2 cannot gather with a unit's floating ones (stage 3 keeps them whole): quantized
    layers under low-rank adapters, and an index table the model holds itself beside a frozen fp32 gain.
    ``in_configure_model``: "layers" builds the layers there (on the meta device at stage 3); "table" the index table
    too, which no initialiser sets there."""

    def __init__(self, in_configure_model: str = "") -> None:
        super().__init__()
        self.in_configure_model = in_configure_model
        if not in_configure_model:
            self.configure_model()
        if in_configure_model != "table":
            self.codes = nn.Parameter(torch.arange(16).flip(0), requires_grad=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 16), requires_grad=False)

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.blocks = nn.ModuleList([QuantizedLinear(8, 16), QuantizedLinear(16, 16)])
        self.head = nn.Linear(16, 1)
        if self.in_configure_model == "table":
            self.codes = nn.Parameter(torch.arange(16).flip(0), requires_grad=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = torch.tanh(self.blocks[0](x)) * self.gain[self.codes]
        return F.mse_loss(self.head(torch.tanh(self.blocks[1](x))), y)


class NormalisedPrototypes(RegressionTask):
    """SwAV's prototypes: normalised in place at the start of every ``training_step``, a write between steps that the
    optimizer's masters must take in (see [Note: parameters written between steps] in
    ``lightning_zero/engine/in_place_writes.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.prototypes = nn.Linear(16, 6, bias=False)
        self.head = nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.prototypes.weight.copy_(F.normalize(self.prototypes.weight.clone(), dim=1))
        x, y = batch
        return F.mse_loss(self.head(self.prototypes(self.body(x))), y)


class MomentumTeacher(RegressionTask):
    """BYOL's, MoCo's and DINO's frozen teacher, moved towards the student after every batch: between the micro-batches
    of one step at stage 3, the module's parameters are the gathered copies an accumulation window keeps (see [Note:
    gathered accumulation windows] in ``lightning_zero/engine/stage3/fsdp2_window.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            target = self.teacher(x + 0.1)
        out = self.student(x)
        return F.mse_loss(out, target) + F.mse_loss(out.sum(1, keepdim=True), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for teacher, student in zip(self.teacher.parameters(), self.student.parameters()):
                teacher.mul_(0.99).add_(student, alpha=0.01)


class EMACodebook(RegressionTask):
    """A VQ-VAE's codebook learned by exponential moving averages (taming-transformers' ``EmbeddingEMA``): frozen
    parameters written inside ``training_step`` from statistics every rank shares (all-reduced, as distributed
    implementations do). At stage 3 they are written while gathered (see [Note: writes into gathered parameters] in
    ``lightning_zero/engine/stage3/fsdp2_window.py``)."""

    def __init__(self, codes: int = 6, width: int = 4, decay: float = 0.9) -> None:
        super().__init__()
        self.encode, self.decode, self.decay = nn.Linear(8, width), nn.Linear(width, 1), decay
        codebook = torch.randn(codes, width)
        self.codebook = nn.Parameter(codebook, requires_grad=False)
        self.cluster_size = nn.Parameter(torch.zeros(codes), requires_grad=False)
        self.code_sum = nn.Parameter(codebook.clone(), requires_grad=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        z = self.encode(x)
        onehot = F.one_hot(torch.cdist(z, self.codebook).argmin(1), len(self.codebook)).to(z.dtype)
        quantized = onehot @ self.codebook
        stats = torch.cat([onehot.sum(0), (onehot.t() @ z.detach()).flatten()])
        torch.distributed.all_reduce(stats)
        with torch.no_grad():
            self.cluster_size.mul_(self.decay).add_(stats[: len(self.codebook)], alpha=1 - self.decay)
            self.code_sum.mul_(self.decay).add_(
                stats[len(self.codebook) :].view_as(self.code_sum), alpha=1 - self.decay
            )
            n = self.cluster_size.sum()
            smoothed = (self.cluster_size + 1e-5) / (n + len(self.codebook) * 1e-5) * n
            self.codebook.copy_(self.code_sum / smoothed.unsqueeze(1))
        return F.mse_loss(self.decode(z + (quantized - z).detach()), y) + 0.25 * F.mse_loss(z, quantized.detach())


class SpectralConv(nn.Module):
    """A Fourier layer's complex weights on the lowest modes of its input (neuraloperator's ``SpectralConv1d``)."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weights = nn.Parameter(torch.rand(channels, channels, modes, dtype=torch.cfloat) / channels**2)

    def forward(self, x):  # (batch, channels, points)
        spectrum = torch.fft.rfft(x.float())
        out = torch.zeros(x.shape[0], x.shape[1], spectrum.shape[-1], dtype=torch.cfloat, device=x.device)
        out[:, :, : self.modes] = torch.einsum("bix,iox->box", spectrum[:, :, : self.modes], self.weights)
        return torch.fft.irfft(out, n=x.shape[-1])


class FourierOperator(RegressionTask):
    """A Fourier neural operator: complex parameters, which autocast and every cast to a real dtype must leave alone
    (a cast to fp32 or bf16 drops the imaginary part), beside real layers; torch's fused optimizer kernels refuse them."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(2, 8)
        self.spectral = nn.ModuleList([SpectralConv(8, 4) for _ in range(2)])
        self.pointwise = nn.ModuleList([nn.Conv1d(8, 8, 1) for _ in range(2)])
        self.project = nn.Linear(8, 1)

    def configure_optimizers(self):  # SGD: bf16-mixed runs then stay close enough to ``ddp`` to tell a lost part
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def training_step(self, batch, batch_idx):
        x, y = batch  # (batch, 8): a function sampled at 8 points, and one target
        grid = torch.linspace(0, 1, 8).expand(x.shape[0], 8)
        h = self.lift(torch.stack([x, grid], -1)).transpose(1, 2)
        for spectral, pointwise in zip(self.spectral, self.pointwise):
            h = F.gelu(spectral(h) + pointwise(h))
        return F.mse_loss(self.project(h.transpose(1, 2)).mean(1).float(), y)


class PrunedMLP(RegressionTask):
    """An MLP for Lightning's ``ModelPruning`` with its defaults: each epoch's end re-registers every weight and bias
    as ``<name>_orig`` with a mask, and resets the survivors to their initial values (the lottery ticket) by
    assigning ``.data``, new storage the optimizer's rows must follow (see [Note: parameters given new storage] in
    ``lightning_zero/engine/stage12/replaced_storage.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)


MODELS = {
    "channels_last": ChannelsLastNet,
    "transposed": TransposedWeight,
    "fp64_head": lambda: TwoDtypes(torch.float32, torch.float64),
    "bf16_body": lambda: TwoDtypes(torch.bfloat16, torch.float32),
    "sparse_sgd": lambda: SparseEmbeddings("sgd"),
    "sparse_adagrad": lambda: SparseEmbeddings("adagrad"),
    "zero_dim": Temperature,
}
