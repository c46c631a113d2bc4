"""Rank program for ``optimizer_state_dtype="bf16"`` (pattern: worker_core): the run against a plain-PyTorch emulation
of the same arithmetic, the bytes its state holds, and checkpoints that resume exactly and load into either dtype."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from tests.distributed import models
from tests.distributed.worker_checkpoint import DATA, final_state, optim_diff, resumed_pairs
from tests.distributed.worker_core import RANK, max_diff, trainer
from tests.distributed.worker_offload import _optimizer_bytes
from tests.launch import run_cases_with_directory

#: (name, stage, ZeroStrategy settings): every place the optimizer steps. Small buckets at stages 1-2, so that the
#: offloaded step runs in parts.
CONFIGS = [
    ("stage1", 1, {}),
    ("stage2", 2, {}),
    ("stage3", 3, {}),
    ("stage1_offload", 1, dict(offload_optimizer=True, bucket_size_mb=0.001)),
    ("stage2_offload", 2, dict(offload_optimizer=True, bucket_size_mb=0.001)),
    ("stage3_offload", 3, dict(offload_optimizer=True)),
    ("stage3_params", 3, dict(offload_optimizer=True, offload_params=True)),
]
STEPS, ACCUMULATE, BATCH, CLIP = 4, 2, 4, 0.5


class RoundedMomentsAdamW(torch.optim.AdamW):
    """The emulation: torch's fp32 AdamW, then every per-element state tensor rounded to bf16 (to nearest even) and
    kept in fp32. Rounding what is already rounded changes nothing, so it may round every entry at every call."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for entry in self.state.values():
            for name, value in entry.items():
                if name != "step" and isinstance(value, torch.Tensor) and value.dim() > 0:
                    value.copy_(value.to(torch.bfloat16))
        return loss


class EmulatedRegression(models.Regression):
    def configure_optimizers(self):
        opt = RoundedMomentsAdamW(models.param_groups(self), lr=1e-2, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run(stage: int, settings: dict, model=models.Regression, precision: str = "32-true") -> L.Trainer:
    """4 steps of 2 accumulated micro-batches with clipping, 2 param groups and a StepLR schedule."""
    L.seed_everything(7)
    t = trainer(
        ZeroStrategy(stage=stage, **settings),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        precision=precision,
    )
    t.fit(model(), models.loader(models.IndexedData(), BATCH))
    return t


def _dtypes(t: L.Trainer) -> list[str]:
    return sorted(
        {
            str(value.dtype).removeprefix("torch.")
            for entry in t.optimizers[0].state.values()
            for name, value in entry.items()
            if name != "step" and isinstance(value, torch.Tensor)
        }
    )


class StateDtypes(L.Callback):
    """The optimizer state's dtypes as the checkpoint left them, before the resumed run's first step."""

    def on_train_start(self, trainer, pl_module):
        self.loaded = _dtypes(trainer)


def exactness() -> dict:
    out = {}
    for name, stage, settings in CONFIGS:
        for precision in ("32-true", "bf16-mixed") if name == "stage2_offload" else ("32-true",):
            held = run(stage, {**settings, "optimizer_state_dtype": "bf16"}, precision=precision)
            emulated = run(stage, settings, model=EmulatedRegression, precision=precision)
            fp32 = run(stage, settings, precision=precision)
            params, optim = final_state(held)
            emulated_params, emulated_optim = final_state(emulated)
            fp32_params, _ = final_state(fp32)
            out[f"{name}_{precision}"] = {
                "steps": held.global_step,
                "state_dtypes": _dtypes(held),
                "fp32_state_dtypes": _dtypes(fp32),
                "state_bytes": _optimizer_bytes(held, host_only=False),
                "host_state_bytes": _optimizer_bytes(held, host_only=True),
                "fp32_state_bytes": _optimizer_bytes(fp32, host_only=False),
                "fp32_host_state_bytes": _optimizer_bytes(fp32, host_only=True),
                **(
                    {
                        "param_diff_emulation": max_diff(params, emulated_params),
                        "state_diff_emulation": optim_diff(optim, emulated_optim),
                        "param_diff_fp32_states": max_diff(params, fp32_params),
                    }
                    if RANK == 0
                    else {}
                ),
            }
    return out


def checkpoints(directory: Path) -> dict:
    """Interrupted after one epoch and resumed, against the straight run; a bf16-state checkpoint loaded by an
    fp32-state run and the other way round."""
    bf16 = {"optimizer_state_dtype": "bf16"}
    pairs = [
        ("sharded_stage2", 2, 2, "sharded"),
        ("full_stage3", 3, 3, "full"),
        ("sharded_stage2_to_3", 2, 3, "sharded"),
    ]
    out = resumed_pairs(directory, pairs, bf16)
    for name, saved, resumed, kind in (
        ("bf16_into_fp32_sharded", bf16, {}, "sharded"),
        ("bf16_into_fp32_full", bf16, {}, "full"),
        ("fp32_into_bf16_full", {}, bf16, "full"),
    ):
        L.seed_everything(7)
        common = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
        first = trainer(ZeroStrategy(stage=2, state_dict_type=kind, **saved), max_epochs=1, **common)
        first.fit(models.Regression(), models.loader(DATA, 4))
        path = first.strategy.broadcast(str(directory / f"{name}.ckpt"))
        first.save_checkpoint(path)
        second = trainer(ZeroStrategy(stage=2, **resumed), max_epochs=2, callbacks=[StateDtypes()], **common)
        second.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=path)
        out[name] = {"steps": second.global_step, "loaded_dtypes": second.callbacks[0].loaded}
    return out


CASES = {"exact": lambda _: exactness(), "checkpoint": checkpoints}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
