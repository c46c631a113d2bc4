"""Small LightningModules and their plain-PyTorch references, shared by the distributed workers."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

IN, OUT = 8, 3


class IndexedData(Dataset):
    """Sample i is a pure function of i, so any rank (and the reference) can rebuild any batch."""

    def __init__(self, n: int = 64, dim: int = IN, out: int = OUT) -> None:
        self.n, self.dim, self.out = n, dim, out

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(self.dim, generator=g)
        y = torch.randn(self.out, generator=g)
        return x, y


def _stacked_pairs(samples: list) -> tuple:
    xs, ys = zip(*samples)
    return torch.stack(xs), torch.stack(ys)


def global_microbatches(
    dataset: Dataset, world: int, batch: int, count: int, collate: Callable[[list], Any] = _stacked_pairs
) -> list[list]:
    """The first ``count`` micro-batches of every rank as Lightning deals them: through a shuffling
    DistributedSampler seeded with the global seed, reshuffled each epoch; each made by ``collate`` (by default an
    ``(x, y)`` pair of stacked tensors)."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    out, epoch = [], 0
    while len(out) < count:
        per_rank = []
        for r in range(world):
            sampler = DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for j in range(len(per_rank[0]) // batch):
            ranks = []
            for r in range(world):
                ranks.append(collate([dataset[i] for i in per_rank[r][j * batch : (j + 1) * batch]]))
            out.append(ranks)
        epoch += 1
    return out[:count]


class Net(nn.Module):
    """Odd row counts (padding), a LayerNorm, a 0-dim-free set of shapes FSDP2 accepts."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 7)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(7, width), nn.GELU(), nn.Linear(width, 7)) for _ in range(2)]
        )
        self.norm = nn.LayerNorm(7)
        self.head = nn.Linear(7, OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


class RoutedExperts(nn.Module):
    """Experts of one shape; each micro-batch goes whole to one of them, picked from its data."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(7, width), nn.GELU(), nn.Linear(width, 7)) for _ in range(3)]
        )

    @staticmethod
    def route(x: torch.Tensor) -> int:
        return int(x[:, 0].sum() > 0)

    def forward(self, h, x):
        return h + self.experts[self.route(x)](h)


class RoutedNet(nn.Module):
    """A block of experts in a ModuleList: ranks with different data use different experts in one step, and the
    third expert is never picked (stage 3's trap: [Note: parameters some ranks leave without a gradient])."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 7)
        self.blocks = nn.ModuleList([RoutedExperts()])
        self.head = nn.Linear(7, OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, x)
        return self.head(h)


def param_groups(module: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


class ReversibleBlock(nn.Module):
    """A RevNet block (Reformer's layers are these): ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``, so the inputs are
    recomputed from the outputs in backward instead of kept."""

    def __init__(self, half: int = 4, width: int = 16) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(half, width), nn.GELU(), nn.Linear(width, half))
        self.g = nn.Sequential(nn.Linear(half, width), nn.GELU(), nn.Linear(width, half))

    def forward(self, x1, x2):
        y1 = x1 + self.f(x2)
        return y1, x2 + self.g(y1)

    def backward_pass(self, y1, y2, dy1, dy2):
        """This block's inputs and their gradients from its outputs'; its halves' parameter gradients accumulate."""
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_(True)
            gy1 = self.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2, dy1 = y2 - gy1, dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_(True)
            fx2 = self.f(x2)
            torch.autograd.backward(fx2, dy1)
        with torch.no_grad():
            return y1 - fx2, x2, dy1, dy2 + x2.grad


class _ReversibleStack(torch.autograd.Function):
    """The blocks' forwards without activations kept; their backward re-runs each block's halves, last block first."""

    @staticmethod
    def forward(ctx, x1, x2, blocks):
        for block in blocks:
            x1, x2 = block(x1, x2)
        ctx.blocks = blocks
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        for block in reversed(ctx.blocks):
            y1, y2, dy1, dy2 = block.backward_pass(y1, y2, dy1, dy2)
        return dy1, dy2, None


class ReversibleNet(nn.Module):
    """``Net`` with reversible blocks: their layers run inside the backward, outside their block's forward (stage
    3's trap: [Note: a unit's layers called in backward])."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 8)
        self.blocks = nn.ModuleList([ReversibleBlock() for _ in range(2)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, OUT)

    def forward(self, x):
        x1, x2 = self.inp(x).chunk(2, dim=-1)
        y1, y2 = _ReversibleStack.apply(x1, x2, tuple(self.blocks))
        return self.head(self.norm(torch.cat([y1, y2], dim=-1)))


def make_optimizer(module: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(param_groups(module), lr=1e-2, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


class Regression(L.LightningModule):
    def __init__(
        self,
        build_in_configure_model: bool = False,
        unused_head: bool = False,
        routed: bool = False,
        penalty: float = 0.0,
        reversible: bool = False,
    ) -> None:
        super().__init__()
        self.build_in_configure_model = build_in_configure_model
        self.penalty = penalty
        built = RoutedNet if routed else ReversibleNet if reversible else Net
        self.net = None if build_in_configure_model else built()
        # A parameter no batch ever uses: plain PyTorch leaves its grad None and AdamW never touches it.
        self.unused = nn.Linear(IN, 4) if unused_head else None
        self.init_rng_state = None

    def configure_model(self) -> None:
        if self.net is None:
            self.init_rng_state = torch.get_rng_state()
            self.net = Net()

    def forward(self, x):
        return self.net(x)

    def loss(self, x, y):
        """MSE; with ``penalty``, plus that times the squared gradient of the outputs by the inputs, taken with
        ``torch.autograd.grad(create_graph=True)`` (a gradient penalty, as WGAN-GP's and R1's)."""
        if not self.penalty:
            return nn.functional.mse_loss(self(x), y)
        x = x.detach().requires_grad_(True)
        out = self(x)
        (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return nn.functional.mse_loss(out, y) + self.penalty * slope.pow(2).sum(1).mean()

    def training_step(self, batch, batch_idx):
        loss = self.loss(*batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt, sched = make_optimizer(self)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class MovedWeightsConsistency(Regression):
    """A consistency loss at 0.9 times the network's weights through ``torch.func.functional_call`` (stages 1-2;
    refused at stage 3: [Note: functional calls on stage 3 units])."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        moved = {name: 0.9 * p for name, p in self.net.named_parameters()}
        shifted = torch.func.functional_call(self.net, moved, (x,))
        return self.loss(x, y) + 0.1 * nn.functional.mse_loss(shifted, y)

    def train_dataloader(self):
        return loader(IndexedData(), 4)


class GradientNormPenalty(Regression):
    """Gradient-norm regularisation: the loss plus 0.01 times the squared gradient of the loss with respect to the
    parameters, through ``torch.autograd.grad(create_graph=True)`` (stages 1-2; at stage 3 the parameters are shards)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(x, y)
        grads = torch.autograd.grad(loss, [p for p in self.parameters() if p.requires_grad], create_graph=True)
        return loss + 0.01 * sum(g.pow(2).sum() for g in grads)

    def train_dataloader(self):
        return loader(IndexedData(), 4)


class ValidatedRegression(Regression):
    """Validated on its training data: the sanity check's forwards run before the first step (under hpZ they leave
    every unit on its node-local shard)."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(*batch), sync_dist=True)


def reference_run(
    initial: dict[str, torch.Tensor],
    dataset: Dataset,
    *,
    world: int,
    batch: int,
    steps: int,
    accumulate: int,
    clip: float,
    clip_algorithm: str = "norm",
    unused_head: bool = False,
    routed: bool = False,
    penalty: float = 0.0,
    reversible: bool = False,
    build=None,
    optimizer=make_optimizer,
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], dict]:
    """Plain single-process PyTorch on the same global batches: final parameters and per-step gradients
    (averaged over the global batch, before clipping) by parameter name, and the optimizer's state dict.
    ``build()``: another module of the same network (default :class:`Regression`); ``optimizer(module)``: its
    optimizer and scheduler."""
    model = (
        build()
        if build is not None
        else Regression(unused_head=unused_head, routed=routed, penalty=penalty, reversible=reversible)
    )
    model.load_state_dict(copy.deepcopy(initial))
    opt, sched = optimizer(model)
    batches = global_microbatches(dataset, world, batch, steps * accumulate)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            per_rank = batches[step * accumulate + micro]
            loss = sum(model.loss(x, y) for x, y in per_rank) / world / accumulate
            loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        if clip and clip_algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        elif clip:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip)
        opt.step()
        sched.step()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, grads, opt.state_dict()


class SkipsSomeSteps(Regression):
    """Lightning's documented pattern for skipping a step: run the closure (forward + backward) only; and, in another
    window, the closure run by hand and then ``optimizer.step()`` without it (a guard that looks at the loss first),
    for which Lightning hands the strategy its ``do_nothing_closure``."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % 4 == 1:  # every other accumulation window (accumulate_grad_batches=2)
            optimizer_closure()
        elif batch_idx % 8 == 3:
            optimizer_closure()
            optimizer.step()
        else:
            optimizer.step(closure=optimizer_closure)


class SteppedByHand(Regression):
    """A trainable gain that no optimizer holds, stepped by a rule of the module's own from its gradient in
    ``on_before_optimizer_step`` every other step, and left to accumulate across windows in between, as DDP
    leaves a parameter that no optimizer's ``zero_grad`` clears."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(OUT))

    def forward(self, x):
        return super().forward(x) * self.gain

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)

    def on_before_optimizer_step(self, optimizer):
        if self.gain.grad is not None and self.global_step % 2 == 0:
            with torch.no_grad():
                self.gain.sub_(0.1 * self.gain.grad)
            self.gain.grad = None


class EndsAnEpochInsideAWindow(Regression):
    """Ends epoch 0 from ``on_train_batch_start`` (returning -1, Lightning's way) at its 4th batch: with
    ``accumulate_grad_batches=2`` the 3rd batch's gradients were accumulated for a step that never comes, and the next
    window's ``zero_grad`` drops them."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.current_epoch == 0 and batch_idx == 3 else None


# ---------------------------------------------------------------------- manual optimization (GAN-style)
class TwoPlayer(L.LightningModule):
    """Generator/discriminator with two optimizers, toggled as Lightning's GAN example does."""

    #: The critic's weights clipped to this after its step (WGAN); None: no clipping.
    clamp: float | None = None

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(3)
        self.gen = nn.Sequential(nn.Linear(IN, 9), nn.Tanh(), nn.Linear(9, IN))
        self.disc = nn.Sequential(nn.Linear(IN, 5), nn.Tanh(), nn.Linear(5, 1))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        g_opt, d_opt = self.optimizers()
        self.toggle_optimizer(g_opt)
        g_loss = -self.disc(self.gen(x)).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        self.clip_gradients(g_opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        g_opt.step()
        self.untoggle_optimizer(g_opt)

        self.toggle_optimizer(d_opt)
        fake = self.gen(x).detach()
        d_loss = (self.disc(fake) - self.disc(x)).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        clamp_critic(self)
        self.untoggle_optimizer(d_opt)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=1e-2), torch.optim.SGD(
            self.disc.parameters(), lr=1e-2, momentum=0.9
        )


class HeadAfterForward(Regression):
    """``training_step`` calls ``self(x)`` and then uses layers outside every block: a margin head on the outputs (as
    ArcFace's on embeddings) and a penalty on the network's own head, both held by stage 3's root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.margin = nn.Linear(OUT, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y) + self.margin(out).square().mean()
        return loss + 0.1 * self.net.head.weight.square().sum()


class SharpnessAware(L.LightningModule):
    """Sharpness-aware minimization (Foret et al.) in manual optimization: ascend ``rho`` along the normalised gradient,
    take the gradient there, step from the weights before the ascent. The ascent reads the gradients of the optimizer's
    parameters, whose norms are global over the shards at stage 3, as a SAM optimizer reads its ``param_groups``."""

    rho = 0.05

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(3)
        self.body = nn.Sequential(nn.Linear(IN, 9), nn.Tanh(), nn.Linear(9, OUT))

    def gradients(self, opt) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, whole averaged gradient) pairs: at stage 3 (and under ``ddp``) the optimizer's parameters."""
        return [(p, p.grad) for group in opt.param_groups for p in group["params"]]

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self.body(x), y))
        with torch.no_grad():
            pairs = self.gradients(opt)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for _, g in pairs]))
            ascent = [(p, g * (self.rho / (norm + 1e-12))) for p, g in pairs]
            for p, e in ascent:
                p.add_(e)
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.body(x), y))
        with torch.no_grad():
            for p, e in ascent:
                p.sub_(e)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SharpnessAwareGathered(SharpnessAware):
    """SAM at stages 1-2, where ``p.grad`` between backward and the step is not the whole gradient (stage 1: this
    rank's rows; stage 2: None): the ascent reads ``trainer.strategy.gather_gradients()``, the whole averaged
    gradients by name on every rank (DeepSpeed's ``safe_get_full_grad``), and moves the whole parameters."""

    def gradients(self, opt) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from lightning_zero import ZeroStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            return super().gradients(opt)
        whole = strategy.gather_gradients(opt)
        return [(p, whole[name]) for name, p in self.named_parameters() if name in whole]


class UntoggledWGAN(TwoPlayer):
    """The same players without ``toggle_optimizer``, as many GANs are written: the generator's loss reaches the
    critic's parameters too, and ``d_opt.zero_grad()`` alone keeps those gradients out of the critic's step; the
    critic's weights clipped after it (WGAN), written between steps where the generator's step gathers them."""

    clamp = 0.05

    def training_step(self, batch, batch_idx):
        x, _ = batch
        g_opt, d_opt = self.optimizers()
        g_opt.zero_grad()
        self.manual_backward(-self.disc(self.gen(x)).mean())
        self.clip_gradients(g_opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        g_opt.step()
        d_opt.zero_grad()
        self.manual_backward((self.disc(self.gen(x).detach()) - self.disc(x)).mean())
        d_opt.step()
        clamp_critic(self)


def clamp_critic(model: TwoPlayer) -> None:
    if model.clamp is not None:
        with torch.no_grad():
            for p in model.disc.parameters():
                p.clamp_(-model.clamp, model.clamp)


def two_player_reference(
    initial: dict, dataset: Dataset, *, world: int, batch: int, steps: int, clamp: float | None = None
) -> dict:
    model = TwoPlayer()
    model.clamp = clamp
    model.load_state_dict(copy.deepcopy(initial))
    g_opt, d_opt = model.configure_optimizers()
    for (per_rank,) in zip(global_microbatches(dataset, world, batch, steps)):
        for p in model.disc.parameters():
            p.requires_grad_(False)
        g_opt.zero_grad()
        sum(-model.disc(model.gen(x)).mean() for x, _ in per_rank).div(world).backward()
        torch.nn.utils.clip_grad_norm_(model.gen.parameters(), 0.5)
        g_opt.step()
        for p in model.disc.parameters():
            p.requires_grad_(True)
        for p in model.gen.parameters():
            p.requires_grad_(False)
        d_opt.zero_grad()
        sum((model.disc(model.gen(x).detach()) - model.disc(x)).mean() for x, _ in per_rank).div(world).backward()
        d_opt.step()
        clamp_critic(model)
        for p in model.gen.parameters():
            p.requires_grad_(True)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


# ---------------------------------------------------------------------- the feature tour
class Tour(L.LightningModule):
    """Frozen parameters, BatchNorm buffers, SGD with momentum, an epoch-interval scheduler, torchmetrics,
    validation/test/predict steps."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(IN, IN)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(IN, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, OUT))
        self.val_mse = torchmetrics.MeanSquaredError()

    def forward(self, x):
        return self.body(self.frozen(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mse(self(x), y)
        self.log("val_mse", self.val_mse, on_epoch=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        opt = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, 0.5), "interval": "epoch"}]


class Wide(L.LightningModule):
    """~5M parameters for the memory formulas; batches are made on the fly so no dataset tensor lingers."""

    def __init__(self, width: int = 1024, depth: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.width = width

    def training_step(self, batch, batch_idx):
        x = batch
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class WideData(Dataset):
    def __init__(self, width: int, n: int = 32) -> None:
        self.width, self.n = width, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.randn(self.width, generator=torch.Generator().manual_seed(i))


def loader(dataset: Dataset, batch: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch, shuffle=False, num_workers=0)


def saved_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds but its RNG states, by its path in the saved dictionary, read whole (a sharded
    directory through ``lightning_zero``'s ``consolidate``, optimizer state included); single process."""
    from pathlib import Path

    from lightning_zero.checkpoint.consolidate import consolidate

    path = Path(path)
    if path.is_dir():
        path = consolidate(path, path.with_name(path.name + ".whole.pt"), include_optimizer=True)
    return {k: v for k, v in _tensors(torch.load(path, weights_only=True)).items() if "rng" not in k}


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def compare_saved(a, b) -> dict:
    """Two checkpoints' tensors (:func:`saved_tensors`): the same names, how many are optimizer state, the largest
    difference."""
    first, second = saved_tensors(a), saved_tensors(b)
    return {
        "names": sorted(first) == sorted(second),
        "optimizer_tensors": sum("optimizer" in k for k in second),
        "max_diff": max((first[k].double() - second[k].double()).abs().max().item() for k in first),
    }
