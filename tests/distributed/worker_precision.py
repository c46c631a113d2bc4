"""Rank program for the mixed-precision tests: many Trainer runs in one process group.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_precision GROUP``); rank 0 writes a JSON
report and ``test_precision.py`` asserts on it.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import sys
import tempfile

import lightning as L
import torch

from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.demo.data import RandomTokenDataset
from lightning_zero.demo.gpt import GPTLightningModule
from lightning_zero.engine.comm.collectives import comm_stats
from tests.distributed import models
from tests.distributed.mixed_reference import fp32_reference, mixed_reference
from tests.distributed.worker_core import StateBytesProbe, max_diff, run_scale, tour, trainer
from tests.launch import run_cases

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))

GPT_KWARGS = dict(
    vocab_size=16, block_size=12, n_layer=2, n_head=2, n_embd=32, learning_rate=3e-3, warmup_steps=4, weight_decay=0.1
)
BATCH, CLIP = 4, 1.0


def gpt_data() -> RandomTokenDataset:
    return RandomTokenDataset(
        num_samples=48, block_size=GPT_KWARGS["block_size"], vocab_size=GPT_KWARGS["vocab_size"], seed=5
    )


def precision_kwargs(precision: str) -> dict:
    """``16-mixed`` goes in as a plugin: on CPU Lightning rewrites ``precision="16-mixed"`` to bf16."""
    if precision == "16-mixed":
        return {"plugins": [ZeroPrecision("16-mixed")]}
    return {"precision": precision}


class LossRecorder(L.Callback):
    """The mean over ranks of every step's training loss, and what the compute parameters are held in. After each
    step's last batch it also reads the gradient norms (``lightning_zero.grad_norm``), where a logging callback would: reading
    the step's gradients after the step must change nothing (stage 3 keeps them until the next backward): the norm
    is the one the step saw, or none (stages 1-2 consume their gradients at the step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.dtypes: dict[str, str] = {}
        self.norms: list[tuple[float, float]] = []  # the total gradient norm before each step, and after it

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning_zero import grad_norm

        self.norms.append((float(grad_norm(pl_module, 2)["grad_2.0_norm_total"]), float("nan")))

    def on_after_backward(self, trainer, pl_module):
        if not self.dtypes:
            self.dtypes = {n: str(p.dtype) for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Lightning hands this hook the loss divided by `accumulate_grad_batches`.
        loss = outputs["loss"].detach().float() * trainer.accumulate_grad_batches
        self.losses.append(trainer.strategy.reduce(loss, reduce_op="mean").item())
        from lightning_zero import grad_norm

        if self.norms and self.norms[-1][1] != self.norms[-1][1]:  # the first batch end since that step's hook
            self.norms[-1] = (self.norms[-1][0], float(grad_norm(pl_module, 2).get("grad_2.0_norm_total", 0.0)))


# ---------------------------------------------------------------------- cases
def tracks_reference(stage: int, precision: str, steps: int = 20, accumulate: int = 1, **strategy_kwargs) -> dict:
    """``strategy_kwargs``: more ZeroStrategy settings (hybrid sharding's ``shard_size``: the emulation sums
    inside each shard group first)."""
    L.seed_everything(11)
    module = GPTLightningModule(**GPT_KWARGS)
    initial = copy.deepcopy(module.state_dict())
    recorder = LossRecorder()
    t = trainer(
        ZeroStrategy(stage=stage, state_dict_type="full", **strategy_kwargs),
        max_steps=steps,
        gradient_clip_val=CLIP,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder],
        **precision_kwargs(precision),
    )
    data = gpt_data()
    t.fit(module, models.loader(data, BATCH))
    plugin = t.strategy.precision_plugin
    final = t.strategy.full_state_dict()
    out = {
        "plugin": type(plugin).__name__,
        "precision": plugin.precision,
        "losses": recorder.losses,
        "dtypes": recorder.dtypes,
        "final_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "loss_scale": plugin.loss_scale,
        "skipped": plugin.scaler.skipped_steps if plugin.scaler is not None else 0,
        "norms": recorder.norms,
        **run_scale(t),
    }
    if RANK == 0:
        kwargs = dict(world=WORLD, batch=BATCH, steps=steps, clip=CLIP)
        reference = fp32_reference(initial, GPT_KWARGS, data, **kwargs, accumulate=accumulate)
        out["fp32_losses"] = reference
        out["loss_diff"] = max(abs(a - b) for a, b in zip(recorder.losses, reference))
        out["loss_drop_fp32"] = reference[0] - reference[-1]
        if precision != "bf16-true" and accumulate == 1:
            emulated = mixed_reference(
                initial,
                GPT_KWARGS,
                data,
                **kwargs,
                policy=plugin.policy(),
                hold_sum_in_param_dtype=stage != 3,
                loss_scale=ZeroPrecision("16-mixed").loss_scale if precision == "16-mixed" else 1.0,
                shard_groups=WORLD // t.strategy.engine.world_size,
            )
            out["master_diff"] = max_diff(final, emulated["params"])
            out["emulated_loss_diff"] = max(abs(a - b) for a, b in zip(recorder.losses, emulated["losses"]))
            out["emulated_skipped"] = emulated["skipped"]
            out["master_change"] = max_diff(emulated["params"], initial)
    return out


class OverflowProbe(L.Callback):
    """Full fp32 parameters and optimizer state after every step, and the loss scale."""

    def __init__(self) -> None:
        self.params: list[dict] = []
        self.optim: list[dict] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        self.params.append(strategy.full_state_dict())
        self.optim.append(
            strategy.optimizer_state(trainer.optimizers[0]) if strategy.zero_config.state_dict_type == "full" else {}
        )
        self.scales.append(strategy.precision_plugin.loss_scale)


class OverflowsOnce(models.Regression):
    """Rank 1's gradient of one weight gets an inf at optimizer step ``at``. The hook goes on the tensor the
    forward uses (in stage 3, FSDP2's unsharded parameter), registered inside the training step."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self._handle = None

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.trainer.global_step == self.at:
            self._handle = self.net.inp.weight.register_hook(_poison)
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def overflow_skips_step(stage: int, at: int = 2, steps: int = 5, **strategy_kwargs) -> dict:
    L.seed_everything(3)
    module = OverflowsOnce(at)
    probe = OverflowProbe()
    t = trainer(
        ZeroStrategy(stage=stage, state_dict_type="full", **strategy_kwargs),
        max_steps=steps,
        gradient_clip_val=0.5,
        callbacks=[probe],
        plugins=[ZeroPrecision("16-mixed", initial_scale=1024.0)],
    )
    t.fit(module, models.loader(models.IndexedData(), 4))
    out = {"steps": t.global_step, "scales": probe.scales, "skipped": t.strategy.precision_plugin.scaler.skipped_steps}
    if RANK == 0:
        before, after = probe.params[at - 1], probe.params[at]
        out["params_unchanged_at_k"] = all(torch.equal(before[k], after[k]) for k in before)
        out["optim_unchanged_at_k"] = _same_optimizer_state(probe.optim[at - 1], probe.optim[at])
        out["params_changed_before_k"] = max_diff(probe.params[at - 2], probe.params[at - 1])
        out["params_changed_after_k"] = max_diff(probe.params[at], probe.params[at + 1])
        out["finite"] = all(torch.isfinite(v).all().item() for v in probe.params[-1].values() if v.is_floating_point())
    return out


def _same_optimizer_state(a: dict, b: dict) -> bool:
    if a["state"].keys() != b["state"].keys():
        return False
    for key, entry in a["state"].items():
        for name, value in entry.items():
            other = b["state"][key][name]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                return False
    return True


def memory(stage: int) -> dict:
    L.seed_everything(0)
    module = models.Wide()
    params = sum(p.numel() for p in module.parameters())
    probe = StateBytesProbe(at_step=2)
    t = trainer(ZeroStrategy(stage=stage), max_steps=3, callbacks=[probe], precision="bf16-mixed")
    t.fit(module, models.loader(models.WideData(module.width), 8))
    return {"bytes": probe.bytes, "params": params}


def built_in_bf16(stage: int) -> dict:
    """A model built in bf16 (as ``from_pretrained(..., torch_dtype=torch.bfloat16)`` loads one) trained in bf16-mixed:
    the model state bytes, the dtype ``fit`` hands the parameters back in, and the final weights."""
    L.seed_everything(0)
    module = models.Wide().to(torch.bfloat16)
    probe = StateBytesProbe(at_step=2)
    t = trainer(ZeroStrategy(stage=stage), max_steps=3, callbacks=[probe], precision="bf16-mixed")
    t.fit(module, models.loader(models.WideData(module.width), 8))
    state = t.strategy.full_state_dict()
    return {
        "bytes": probe.bytes,
        "params": sum(p.numel() for p in module.parameters()),
        "final_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "state": {k: digest(v) for k, v in state.items()} if RANK == 0 else {},
    }


def digest(tensor: torch.Tensor) -> str:
    """The tensor's dtype, shape and bytes in a line: equal for bit-identical tensors (a 5M-element state as JSON
    lists would cost the report hundreds of megabytes)."""
    data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype} {tuple(tensor.shape)} {hashlib.sha256(data).hexdigest()}"


class CommBytes(L.Callback):
    def __init__(self) -> None:
        self.bytes: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        comm_stats().reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.bytes.append(comm_stats().snapshot()["bytes"])


def communication(stage: int, precision: str) -> dict:
    L.seed_everything(0)
    module = models.Wide(width=64, depth=3)
    probe = CommBytes()
    t = trainer(ZeroStrategy(stage=stage), max_steps=2, callbacks=[probe], **precision_kwargs(precision))
    t.fit(module, models.loader(models.WideData(module.width), 4))
    return {"bytes": probe.bytes[-1], "params": sum(p.numel() for p in module.parameters())}


def scaler_checkpoint(stage: int) -> dict:
    """A 16-mixed checkpoint carries the loss scale and its counters, and resumes them."""
    directory = collectives_tempdir()
    L.seed_everything(3)
    first = trainer(
        ZeroStrategy(stage=stage),
        max_steps=3,
        plugins=[ZeroPrecision("16-mixed", initial_scale=512.0, growth_interval=2)],
    )
    first.fit(OverflowsOnce(at=1), models.loader(models.IndexedData(), 4))
    path = os.path.join(directory, "mixed.ckpt")
    first.save_checkpoint(path)
    saved = first.strategy.precision_plugin.state_dict()
    saved_params = first.strategy.full_state_dict()
    second = trainer(
        ZeroStrategy(stage=stage),
        max_steps=4,
        plugins=[ZeroPrecision("16-mixed", initial_scale=512.0, growth_interval=2)],
    )
    module = models.Regression()
    resumed = {}

    class Capture(L.Callback):
        def on_train_start(self, trainer, pl_module):
            resumed["state"] = trainer.strategy.precision_plugin.state_dict()
            resumed["params"] = trainer.strategy.full_state_dict()

    second.callbacks.append(Capture())
    second.fit(module, models.loader(models.IndexedData(), 4), ckpt_path=path)
    out = {"saved": saved, "resumed": resumed["state"]}
    if RANK == 0:
        out["params_diff"] = max_diff(saved_params, resumed["params"])
        out["param_dtypes"] = sorted({str(v.dtype) for v in saved_params.values()})
    torch.distributed.barrier()  # every rank has read the checkpoint
    if RANK == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def tour_mixed(stage: int) -> dict:
    """Frozen layer, BatchNorm, SGD, epoch scheduler, metrics and every loop, in bf16-mixed."""
    recorder = LossRecorder()
    out = tour(stage, precision="bf16-mixed", callbacks=[recorder])
    return {**out, "dtypes": recorder.dtypes}


def collectives_tempdir() -> str:
    from lightning_zero.engine.comm import collectives

    return collectives.broadcast_object(tempfile.mkdtemp(prefix="lz-precision-") if RANK == 0 else None)


#: Every run of the loss-curve and master-weight tests: each stage and precision, and under accumulation.
_TRACKING = [
    *(f"stage{s}_{p}" for s in (1, 2, 3) for p in ("bf16-mixed", "16-mixed", "bf16-true")),
    *(f"stage{s}_{p}_accumulate" for s in (1, 2, 3) for p in ("bf16-mixed", "16-mixed")),
]
#: `make test`'s share: each stage, each precision and accumulation at least once.
TRACKED = (
    "stage1_16-mixed",
    "stage2_bf16-mixed",
    "stage3_bf16-mixed",
    "stage3_16-mixed",
    "stage2_bf16-true",
    "stage3_16-mixed_accumulate",
)


def tracked(key: str) -> dict:
    stage, precision, *accumulate = key.removeprefix("stage").split("_")
    if accumulate:
        return tracks_reference(int(stage), precision, steps=10, accumulate=2)
    return tracks_reference(int(stage), precision)


CASES = {
    "tracking": lambda: {key: tracked(key) for key in TRACKED},
    "tracking_rest": lambda: {key: tracked(key) for key in _TRACKING if key not in TRACKED},
    "overflow": lambda: {f"stage{s}": overflow_skips_step(s) for s in (1, 2, 3)},
    "costs": lambda: {
        **{f"memory_stage{s}": memory(s) for s in (1, 2, 3)},
        **{f"built_in_bf16_stage{s}": built_in_bf16(s) for s in (2, 3)},
        **{f"comm_stage{s}_{p}": communication(s, p) for s in (1, 2, 3) for p in ("32-true", "bf16-mixed")},
        **{f"checkpoint_stage{s}": scaler_checkpoint(s) for s in (2, 3)},
        **{f"tour_stage{s}": tour_mixed(s) for s in (1, 2, 3)},
    },
}


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
