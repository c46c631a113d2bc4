"""Matrix optimizers (Muon, Adafactor and a MuonWithAuxAdam-style mix) on the shared test model, with plain
single-process references: what the matrix-optimizer worker trains under ZeroStrategy."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.optim import Optimizer

from tests.distributed import models


def newton_schulz_fp32(grad: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration, in fp32 (torch's runs in bf16, whose roundings
    flip under gradient reduction-order noise)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = grad.float()
    transposed = grad.size(0) > grad.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class CountingNewtonSchulz:
    """Newton-Schulz calls, and the full shapes they ran on, in this process: ours, and torch.optim.Muon's
    (:meth:`count_torch` wraps torch's function, still calling it)."""

    calls: list[tuple[int, ...]] = []

    @classmethod
    def reset(cls) -> None:
        cls.calls = []

    @classmethod
    def count_torch(cls) -> None:
        import torch.optim._muon as muon

        original = muon._zeropower_via_newtonschulz
        if getattr(original, "counted", False):
            return

        def counted(grad, *args, **kwargs):
            cls.calls.append(tuple(grad.shape))
            return original(grad, *args, **kwargs)

        counted.counted = True
        muon._zeropower_via_newtonschulz = counted


def _muon_update(param, grad, state, group) -> None:
    buf = state.setdefault("momentum_buffer", torch.zeros_like(grad))
    buf.lerp_(grad, 1 - group["momentum"])
    update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
    CountingNewtonSchulz.calls.append(tuple(param.shape))
    update = newton_schulz_fp32(update)
    ratio = max(1.0, param.size(0) / param.size(1)) ** 0.5
    param.mul_(1 - group["lr"] * group["weight_decay"])
    param.add_(update, alpha=-group["lr"] * ratio)


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class FP32Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in fp32 (declared through ``matrix_optimizers``)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _muon_update(p, p.grad, self.state[p], group)
        return loss


class MuonWithAuxAdam(Optimizer):
    """One optimizer, two kinds of groups (as Keller Jordan's ``MuonWithAuxAdam``): ``use_muon=True`` groups
    run fp32 Muon on whole matrices, ``use_muon=False`` groups run AdamW element-wise."""

    def __init__(self, groups: list[dict]) -> None:
        defaults = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    _muon_update(p, p.grad, state, group)
                    continue
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"].item()
                beta1, beta2 = group["betas"]
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))
        return loss


def matrices(module: nn.Module) -> list[nn.Parameter]:
    """The hidden 2-D weights Muon is meant for (the input and output layers stay with AdamW)."""
    return [p for n, p in module.named_parameters() if p.dim() == 2 and ".blocks." in f".{n}"]


def others(module: nn.Module) -> list[nn.Parameter]:
    ids = {id(p) for p in matrices(module)}
    return [p for p in module.parameters() if id(p) not in ids]


def build_optimizer(kind: str, module: nn.Module) -> Optimizer:
    if kind == "aux_adam":
        return MuonWithAuxAdam(
            [
                {"params": matrices(module), "use_muon": True, "lr": 0.02, "weight_decay": 0.01},
                {"params": others(module), "use_muon": False, "lr": 1e-2, "weight_decay": 0.1},
            ]
        )
    if kind == "adafactor":
        return torch.optim.Adafactor(
            [
                {"params": [p for p in module.parameters() if p.dim() >= 2], "weight_decay": 0.01},
                {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=0.05,
        )
    raise ValueError(kind)


class MatrixRegression(models.Regression):
    """The shared regression model trained by one matrix optimizer (``kind``), with a StepLR schedule."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = build_optimizer(self.kind, self)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def reference(
    kind: str, initial: dict, dataset, *, world: int, batch: int, steps: int, accumulate: int, clip: float
) -> dict:
    """Plain single-process PyTorch on the same global batches."""

    def optimizer(module):
        opt = build_optimizer(kind, module)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    return models.reference_run(
        initial,
        dataset,
        world=world,
        batch=batch,
        steps=steps,
        accumulate=accumulate,
        clip=clip,
        build=lambda: MatrixRegression(kind),
        optimizer=optimizer,
    )[0]


class TwoOptimizers(models.Regression):
    """Manual optimization: a Muon for the hidden matrices and an AdamW for the rest, ``accumulate``
    micro-batches per step, each optimizer's gradients clipped by their norm, as a user writes it."""

    def __init__(self, muon: type[Optimizer] = torch.optim.Muon, accumulate: int = 2, clip: float = 0.5) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.muon, self.accumulate, self.clip = muon, accumulate, clip

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            for opt in self.optimizers():
                self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()
        return loss

    def configure_optimizers(self):
        return two_optimizers(self, self.muon)


def two_optimizers(module: nn.Module, muon: type[Optimizer]) -> tuple[Optimizer, Optimizer]:
    return muon(matrices(module), lr=0.02, weight_decay=0.01), torch.optim.AdamW(others(module), lr=1e-2)


def two_optimizers_reference(
    initial: dict,
    dataset,
    muon: type[Optimizer],
    *,
    world: int,
    batch: int,
    steps: int,
    accumulate: int = 2,
    clip: float = 0.5,
) -> dict:
    model = TwoOptimizers(muon)
    model.load_state_dict(copy.deepcopy(initial))
    opts = two_optimizers(model, muon)
    batches = models.global_microbatches(dataset, world, batch, steps * accumulate)
    for step in range(steps):
        for micro in range(accumulate):
            per_rank = batches[step * accumulate + micro]
            (sum(nn.functional.mse_loss(model(x), y) for x, y in per_rank) / world / accumulate).backward()
        for opt in opts:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def hf_module(kind: str):
    """``tests.distributed.hf_models.HFLightningModule`` trained by a matrix optimizer: Adafactor on everything, or
    fp32 Muon on the 2-D weights inside the layers (GPT-2's Conv1D included) and AdamW on the rest (embeddings, norms,
    biases)."""
    from tests.distributed.hf_models import HFLightningModule

    class MatrixHF(HFLightningModule):
        def configure_optimizers(self):
            if kind == "adafactor":
                opt = torch.optim.Adafactor(models.param_groups(self), lr=0.01)
            else:
                hidden = [p for n, p in self.named_parameters() if p.dim() == 2 and (".h." in n or ".layers." in n)]
                ids = {id(p) for p in hidden}
                opt = MuonWithAuxAdam(
                    [
                        {"params": hidden, "use_muon": True, "lr": 0.02, "weight_decay": 0.01},
                        {"params": [p for p in self.parameters() if id(p) not in ids], "use_muon": False, "lr": 3e-3},
                    ]
                )
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return MatrixHF
