"""Rank program for ``test_precision_zoo.py``: the zoo of ``precision_zoo.py`` in bf16-mixed and 16-mixed at
every stage and with offload, and the same modules under Lightning's ``ddp`` for comparison.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_precision_zoo GROUP``); rank 0 reports.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.engine.mixed_precision import mixed_state_bytes
from lightning_zero.planning.accounting import model_state_bytes
from tests.distributed.precision_zoo import ZOO, FeatureModel, RoutedBlock, data_for
from tests.distributed.worker_core import trainer
from tests.launch import run_cases

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
STEPS = 4


class Observer(L.Callback):
    """Losses (mean over ranks), the dtype each parameter is used in by forward, and model-state bytes
    right after the last backward."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.used_dtypes: dict[str, str] = {}
        self.state: dict[str, int] | None = None
        self._hooks = []

    def on_train_start(self, trainer, pl_module):
        for module_name, module in pl_module.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._hooks.append(module.register_forward_pre_hook(self._recorder(module_name)))

    def _recorder(self, module_name: str):
        def record(module, args):
            for name, p in module.named_parameters(recurse=False):
                self.used_dtypes.setdefault(f"{module_name}.{name}" if module_name else name, str(p.dtype))

        return record

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == STEPS - 1 and isinstance(trainer.strategy, ZeroStrategy):
            optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
            self.state = model_state_bytes(pl_module, optimizers, trainer.strategy.engine)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean").item())

    def on_train_end(self, trainer, pl_module):
        for hook in self._hooks:
            hook.remove()


def expected_fp32(module: torch.nn.Module) -> set[str]:
    """The rule under test, written out: a layer without a matrix among its own parameters holds them fp32, and so
    does every layer inside one that sets ``self.dtype = torch.float32`` (a router that casts itself to it), and so
    do the inputs of a reparametrized weight (``parametrizations.*.original*``, and a hook-based weight norm's layer)."""
    out = set()
    for module_name, sub in module.named_modules():
        own = list(sub.named_parameters(recurse=False))
        hooked = any(n.endswith("weight_g") for n, _ in own)
        if own and (all(p.dim() < 2 for _, p in own) or hooked or ".parametrizations." in f".{module_name}."):
            out.update(f"{module_name}.{n}" if module_name else n for n, _ in own)
        if vars(sub).get("dtype") is torch.float32:
            out.update(f"{module_name}.{n}" if module_name else n for n, _ in sub.named_parameters())
    return out


def fit(name: str, strategy, precision: str, accumulate: int = 1, build=None) -> dict:
    L.seed_everything(3)
    module = (build or ZOO[name])()
    fp32_names = expected_fp32(module)
    counts = {"compute": 0, "fp32": 0}
    for pname, p in module.named_parameters():
        counts["fp32" if pname in fp32_names else "compute"] += p.numel()
    observer = Observer()
    # 16-mixed goes in as a plugin (on CPU Lightning rewrites the string to bf16), with a loss scale that does
    # not overflow at the first steps, so the optimizer state exists when the bytes are counted.
    kwargs = (
        {"plugins": [ZeroPrecision("16-mixed", initial_scale=2.0**8)]}
        if precision == "16-mixed"
        else {"precision": precision}
    )
    t = trainer(strategy, max_steps=STEPS, callbacks=[observer], accumulate_grad_batches=accumulate, **kwargs)
    t.fit(module, data_for(name))
    out = {"losses": observer.losses, "used_dtypes": observer.used_dtypes, "fp32_names": sorted(fp32_names), **counts}
    if isinstance(strategy, ZeroStrategy):
        out["state"] = observer.state
        full = strategy.full_state_dict()
    else:
        full = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    if RANK == 0:
        out["finite"] = all(bool(torch.isfinite(v).all()) for v in full.values() if v.is_floating_point())
        out["params"] = {k: v.float().flatten().tolist() for k, v in full.items() if v.is_floating_point()}
        out["final_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
    return out


def zero(name: str, stage: int, precision: str, accumulate: int = 1, **options) -> dict:
    out = fit(name, ZeroStrategy(stage=stage, **options), precision, accumulate)
    offload = bool(options.get("offload_optimizer") or options.get("offload_params"))
    out["formula"] = mixed_state_bytes(out["compute"], out["fp32"], WORLD, stage, offload=offload)
    return out


LAYOUTS = {"stage1": dict(stage=1), "stage2": dict(stage=2), "stage3": dict(stage=3)}
OFFLOAD = {
    "stage2_offload": dict(stage=2, offload_optimizer=True),
    "stage3_offload": dict(stage=3, offload_params=True),
}


def zoo_cases(names, precisions, layouts) -> dict:
    return {
        f"{name}/{precision}/{layout}": zero(name, precision=precision, **options)
        for name in names
        for precision in precisions
        for layout, options in layouts.items()
    }


CASES = {
    # What `make test` runs: every model in bf16-mixed at every stage, fp16 and offload on two of them.
    "default": lambda: {
        **zoo_cases(ZOO, ["bf16-mixed"], LAYOUTS),
        **zoo_cases(["prenorm_mlp", "embedding_norms"], ["16-mixed"], {"stage2": dict(stage=2)}),
        **zoo_cases(["prenorm_mlp", "conv_groupnorm"], ["bf16-mixed"], OFFLOAD),
        **{f"{name}/bf16-mixed/ddp": fit(name, "ddp", "bf16-mixed") for name in ZOO},
        # Stage 3 keeps its units gathered through an accumulation window, where the router's cast met FSDP2's `_apply`.
        **{
            f"accumulated/self_casting_router/stage{s}": zero("self_casting_router", s, "bf16-mixed", accumulate=2)
            for s in (1, 3)
        },
        **{
            f"bf16-true/self_casting_router/stage{s}": fit(
                "self_casting_router",
                ZeroStrategy(stage=s),
                "bf16-true",
                build=lambda: FeatureModel(RoutedBlock, torch.bfloat16),
            )
            for s in (1, 2, 3)
        },
    },
    # `make test-all`: the whole matrix.
    "full": lambda: zoo_cases(ZOO, ["bf16-mixed", "16-mixed"], {**LAYOUTS, **OFFLOAD}),
}


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
