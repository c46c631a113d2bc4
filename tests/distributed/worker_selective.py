"""Rank program for selective updates (``offload_update_interval=k``; pattern: worker_core): the run against a
plain-PyTorch emulation of the same arithmetic, and checkpoints that resume exactly, mid-interval with a host step in
flight, at the same and at another world size."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import state_dicts
from lightning_zero.engine.state_dict import gather_full
from tests.distributed import models
from tests.distributed.worker_checkpoint import COMMON, DATA, optim_diff, resumed_pairs
from tests.distributed.worker_core import RANK, WORLD, max_diff, trainer
from tests.launch import run_cases_with_directory

STEPS, ACCUMULATE, BATCH, CLIP = 10, 2, 4, 0.5
#: (name, stage, interval k, select interval, routed experts, overlap_step): columns chosen at step 0, then after steps 3 and 7
#: (k=2), 7 (k=4) or every interval.
CASES_EXACT = [
    ("stage1_k2", 1, 2, 4, False, True),
    ("stage2_k2", 2, 2, 4, False, True),
    ("stage2_k4", 2, 4, 8, False, True),
    ("stage2_k2_every_interval", 2, 2, 2, False, True),
    ("stage2_k4_without_overlap", 2, 4, 4, False, False),
    ("stage2_k2_experts", 2, 2, 4, True, True),
]
RATIO = 0.3


def selective(interval: int, select: int, overlap: bool = True, **more) -> dict:
    return dict(
        offload_optimizer=True,
        offload_update_interval=interval,
        offload_topk_ratio=RATIO,
        offload_select_interval=select,
        offload_overlap_step=overlap,
        bucket_size_mb=0.001,
        **more,
    )


class SelectiveAdamWEmulation(torch.optim.AdamW):
    """Plain PyTorch on whole tensors, one process: torch's single-tensor AdamW arithmetic, per column, on the
    schedule of [Note: selective updates] (``lightning_zero/engine/offload/selective.py``). ``p`` is what forward
    computes with; ``master`` holds every update taken, the host's ahead of ``p`` until they land."""

    def __init__(self, params, interval: int, select: int, overlap: bool, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.interval, self.select, self.overlap = interval, select, overlap
        self.steps_taken = 0
        self.lands_at: int | None = None
        #: Columns that joined the device at a choice after the first (each also left it).
        self.moved = 0
        self.columns: dict[torch.Tensor, dict] = {}

    @staticmethod
    def _view(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(-1, 1)

    def _entry(self, p: torch.Tensor) -> dict:
        if p not in self.columns:
            columns = self._view(p).shape[1]
            self.columns[p] = {
                "master": self._view(p.detach()).clone(),
                "exp_avg": torch.zeros_like(self._view(p)),
                "exp_avg_sq": torch.zeros_like(self._view(p)),
                "steps": torch.zeros(columns, dtype=torch.float64),
                "selected": torch.full((columns,), p.dim() < 2),
                "sums": [None, None],
            }
        return self.columns[p]

    @staticmethod
    def _adam(group, master, grad, exp_avg, exp_avg_sq, steps) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step_size = (lr / (1 - torch.pow(beta1, steps))).float()
        correction = (1 - torch.pow(beta2, steps)).sqrt().float()
        master.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction).add_(eps)
        master.sub_(exp_avg / denom * step_size)

    def _step_columns(self, group, entry, grad, columns) -> None:
        parts = [entry[key].index_select(1, columns) for key in ("master", "exp_avg", "exp_avg_sq")]
        self._adam(group, *parts[:1], grad.index_select(1, columns), *parts[1:], entry["steps"][columns])
        for key, part in zip(("master", "exp_avg", "exp_avg_sq"), parts):
            entry[key].index_copy_(1, columns, part)

    def land(self) -> None:
        if self.lands_at is None:
            return
        self.lands_at = None
        for p, entry in self.columns.items():
            self._view(p.data).copy_(entry["master"])

    def _choose(self, members) -> None:
        for _, p in members:
            entry = self.columns[p]
            if p.dim() < 2:
                continue
            if p.grad is None:
                continue  # no gradient this step: its choice stays
            columns = entry["selected"].numel()
            norms = self._view(p.grad).double().square().sum(0)
            order = torch.sort(norms, descending=True, stable=True).indices[: math.ceil(RATIO * columns)]
            entry["selected"] = torch.zeros(columns, dtype=torch.bool)
            entry["selected"][order] = True

    @torch.no_grad()
    def step(self, closure=None):
        k, s = self.interval, self.steps_taken
        members = [(group, p) for group in self.param_groups for p in group["params"]]
        entries = {p: self._entry(p) for _, p in members}
        if s == 0:
            self._choose(members)
        buffer = (s // k) % 2
        for group, p in members:
            if p.grad is None:
                continue
            entry, grad = entries[p], self._view(p.grad)
            chosen = entry["selected"].nonzero().view(-1)
            entry["steps"][chosen] += 1
            self._step_columns(group, entry, grad, chosen)
            self._view(p.data).index_copy_(1, chosen, entry["master"].index_select(1, chosen))
            sums = entry["sums"]
            sums[buffer] = grad.clone() if sums[buffer] is None else sums[buffer].add_(grad)
        if s % k == k - 1:
            if self.lands_at == s:
                self.land()
            previous = {p: entries[p]["selected"] for _, p in members}
            if (s + 1) % self.select == 0:
                # Columns that join step this interval's mean gradient at once; those that leave wait, unchanged.
                self._choose(members)
                for group, p in members:
                    entry = entries[p]
                    joining = (entry["selected"] & ~previous[p]).nonzero().view(-1)
                    total = entry["sums"][buffer]
                    self.moved += joining.numel()
                    if total is not None and joining.numel():
                        entry["steps"][joining] += 1
                        self._step_columns(group, entry, total.div(k), joining)
                        self._view(p.data).index_copy_(1, joining, entry["master"].index_select(1, joining))
            stepped = False
            for group, p in members:
                entry = entries[p]
                total = entry["sums"][buffer]
                if total is None:
                    continue
                entry["sums"][buffer] = None
                rest = (~(entry["selected"] | previous[p])).nonzero().view(-1)
                entry["steps"][rest] += 1
                self._step_columns(group, entry, total.div_(k), rest)
                stepped = True
            self.lands_at = s + k if stepped else None
            if stepped and not self.overlap:
                self.land()
        self.steps_taken = s + 1


def emulated_run(initial: dict, data, interval: int, select: int, overlap: bool, **common):
    """``models.reference_run`` with the emulation; the host step in flight lands at the end, as ``fit``'s does."""
    made = []

    def make(module):
        groups = models.param_groups(module)
        opt = SelectiveAdamWEmulation(groups, interval, select, overlap, lr=1e-2, betas=(0.9, 0.95))
        made.append((module, opt))
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    models.reference_run(initial, data, optimizer=make, **common)
    module, opt = made[0]
    opt.land()
    return {name: value.detach().clone() for name, value in module.state_dict().items()}, opt.moved


def exactness() -> dict:
    """``STEPS`` steps of 2 accumulated micro-batches with clipping, 2 param groups and a StepLR schedule, against
    the emulation and against plain AdamW."""
    out = {}
    data = models.IndexedData()
    for name, stage, interval, select, routed, overlap in CASES_EXACT:
        L.seed_everything(7)
        module = models.Regression(routed=routed)
        initial = {k: v.clone() for k, v in module.state_dict().items()}
        t = trainer(
            ZeroStrategy(stage=stage, state_dict_type="full", **selective(interval, select, overlap)),
            max_steps=STEPS,
            accumulate_grad_batches=ACCUMULATE,
            gradient_clip_val=CLIP,
        )
        t.fit(module, models.loader(data, BATCH))
        final = t.strategy.full_state_dict()
        out[name] = {"steps": t.global_step}
        if RANK == 0:
            common = dict(world=WORLD, batch=BATCH, steps=STEPS, accumulate=ACCUMULATE, clip=CLIP, routed=routed)
            emulated, moved = emulated_run(initial, data, interval, select, overlap, **common)
            exact, _, _ = models.reference_run(initial, data, **common)
            out[name].update(
                param_diff_emulation=max_diff(final, emulated),
                param_diff_exact=max_diff(final, exact),
                emulation_vs_exact=max_diff(emulated, exact),
                param_change=max_diff(exact, initial),
                columns_moved=moved,
            )
    return out


def checkpoints(directory: Path) -> dict:
    """One epoch (3 steps: mid-interval, the interval's sum filled, a host step in flight and columns that left the
    device waiting for it), a checkpoint, a new Trainer for the second epoch, against the uninterrupted run; the last
    resumes a stage-2 checkpoint at stage 1."""
    pairs = [
        ("sharded_stage2", 2, 2, "sharded"),
        ("full_stage1", 1, 1, "full"),
        ("sharded_stage2_to_1", 2, 1, "sharded"),
    ]
    return resumed_pairs(directory, pairs, selective(2, 2))


def _selective_whole(t: L.Trainer) -> dict[str, torch.Tensor]:
    """The engine's selective state with each rank's rows of the sums gathered whole (collective)."""
    engine = t.strategy.engine
    records = {record.name: record for record in engine.records()}
    out = {}
    for name, entry in sorted(engine.selective_state().items()):
        for key, value in entry.items():
            whole = gather_full(value, records[name].shape, group=records[name].group) if key == "sums" else value
            out[f"{name}.{key}"] = whole.double()
    return out


def _seen(module) -> dict[str, torch.Tensor]:
    """The parameters forward computes with."""
    return {name: p.detach().clone() for name, p in module.named_parameters()}


class SaveMidInterval(L.Callback):
    """Saves both formats after step 3 (mid-interval, a host step in flight) with what they hold."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 3 or (batch_idx + 1) % ACCUMULATE:
            return
        seen = _seen(pl_module)
        trainer.save_checkpoint(self.directory / "selective_sharded")
        strategy = trainer.strategy
        saved_config = strategy.zero_config
        strategy.zero_config = ZeroStrategy(stage=2, state_dict_type="full", **selective(2, 2)).zero_config
        trainer.save_checkpoint(self.directory / "selective_full.ckpt")
        strategy.zero_config = saved_config
        expected = {
            "seen": seen,
            "selective": _selective_whole(trainer),
            "optim": state_dicts.full_optimizer_state(trainer.optimizers[0], pl_module, strategy.engine),
            "pending": strategy.engine.lagging_rows() is not None,
            "leaving": sum(
                param.leaving is not None
                for param in strategy.engine.optimizer_shards(trainer.optimizers[0]).selective.params.values()
            ),
        }
        if RANK == 0:
            torch.save(expected, self.directory / "selective_expected.pt")


def save_mid_interval(directory: Path) -> dict:
    L.seed_everything(7)
    t = trainer(ZeroStrategy(stage=2, **selective(2, 2)), max_steps=4, callbacks=[SaveMidInterval(directory)], **COMMON)
    t.fit(models.Regression(), models.loader(DATA, 4))
    return {}


class RestoredSelective(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.seen = _seen(pl_module)
        self.selective = _selective_whole(trainer)
        self.optim = state_dicts.full_optimizer_state(trainer.optimizers[0], pl_module, trainer.strategy.engine)


def resume_in_other_world(directory: Path) -> dict:
    """At this world size, resume what :func:`save_mid_interval` saved at 2 ranks; what the run holds before its
    first step equals what was saved, and it trains on."""
    expected = torch.load(directory / "selective_expected.pt", weights_only=True)
    out = {"world": WORLD, "pending_at_save": expected["pending"], "leaving_at_save": expected["leaving"]}
    for name in ("selective_sharded", "selective_full.ckpt"):
        probe = RestoredSelective()
        L.seed_everything(7)
        t = trainer(ZeroStrategy(stage=2, **selective(2, 2)), max_steps=6, callbacks=[probe], **COMMON)
        t.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=str(directory / name))
        if RANK == 0:
            out[name] = {
                "seen_diff": max_diff(probe.seen, expected["seen"]),
                "selective_diff": max_diff(probe.selective, expected["selective"]),
                "selective_keys": sorted(probe.selective) == sorted(expected["selective"]),
                "optim_diff": optim_diff(probe.optim, expected["optim"]),
                "steps": t.global_step,
                "finite": all(bool(torch.isfinite(v).all()) for v in t.strategy.full_state_dict().values()),
            }
    L.seed_everything(7)
    t = trainer(ZeroStrategy(stage=2, **selective(4, 4)), max_steps=6, **COMMON)
    try:
        t.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=str(directory / "selective_sharded"))
        out["other_settings"] = "resumed"
    except ValueError as error:
        out["other_settings"] = str(error)
    return out


class HeadUnfrozenAtEpochOne(models.Regression):
    """A linear head beside the network, frozen when fit starts and unfrozen, in a param group of its own, when epoch
    1 starts: the layout grows and a group joins after selective updates took steps."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(models.IN, models.OUT)
        self.head.requires_grad_(False)

    def forward(self, x):
        return super().forward(x) + self.head(x)


class UnfreezeHead(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            unfreeze(pl_module, trainer.optimizers[0])


def unfreeze(module, optimizer) -> None:
    module.head.requires_grad_(True)
    optimizer.add_param_group({"params": list(module.head.parameters()), "weight_decay": 0.1})


GROWTH_STEPS, STEPS_PER_EPOCH = 8, 4  # IndexedData(64) on 2 ranks, batches of 4, 2 accumulated


def growth() -> dict:
    """The head joins at step 4 of 8 (k=2, columns chosen every interval), against the emulation doing the same in
    plain PyTorch (the head frozen, so without gradients, until then)."""
    data = models.IndexedData()
    L.seed_everything(7)
    module = HeadUnfrozenAtEpochOne()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    t = trainer(
        ZeroStrategy(stage=2, state_dict_type="full", **selective(2, 2)),
        max_steps=GROWTH_STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        callbacks=[UnfreezeHead()],
    )
    t.fit(module, models.loader(data, BATCH))
    final = t.strategy.full_state_dict()
    out: dict = {"steps": t.global_step, "growths": len(t.strategy.engine.growths)}
    if RANK == 0:
        reference = HeadUnfrozenAtEpochOne()
        reference.load_state_dict(initial)
        opt = SelectiveAdamWEmulation(models.param_groups(reference), 2, 2, True, lr=1e-2, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        batches = models.global_microbatches(data, WORLD, BATCH, GROWTH_STEPS * ACCUMULATE)
        for step in range(GROWTH_STEPS):
            if step == STEPS_PER_EPOCH:
                unfreeze(reference, opt)
            opt.zero_grad()
            for micro in range(ACCUMULATE):
                loss = sum(reference.loss(x, y) for x, y in batches[step * ACCUMULATE + micro]) / WORLD / ACCUMULATE
                loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], CLIP)
            opt.step()
            sched.step()
        opt.land()
        emulated = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        out.update(
            param_diff_emulation=max_diff(final, emulated),
            head_change=max_diff(
                {k: final[k] for k in final if k.startswith("head.")},
                {k: initial[k] for k in final if k.startswith("head.")},
            ),
        )
    return out


class SGDRegression(models.Regression):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def edges() -> dict:
    """An optimizer selective updates cannot run is refused on every rank before the first step; bf16-mixed trains,
    and the end of fit leaves fp32 weights equal to the masters, the device's columns included."""
    out: dict = {}
    L.seed_everything(7)
    t = trainer(ZeroStrategy(stage=2, **selective(2, 4)), max_steps=2)
    try:
        t.fit(SGDRegression(), models.loader(models.IndexedData(), BATCH))
        out["sgd"] = "trained"
    except TypeError as error:
        out["sgd"] = str(error)
    L.seed_everything(7)
    module = models.Regression()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    t = trainer(
        ZeroStrategy(stage=2, state_dict_type="full", **selective(2, 4)),
        max_steps=7,
        precision="bf16-mixed",
        gradient_clip_val=CLIP,
    )
    t.fit(module, models.loader(models.IndexedData(), BATCH))
    final = t.strategy.full_state_dict()
    seen = _seen(module)
    if RANK == 0:
        out["mixed"] = {
            "steps": t.global_step,
            "dtypes": sorted({str(p.dtype) for p in module.parameters()}),
            "change": max_diff(final, initial),
            "seen_vs_masters": max_diff(seen, final),
        }
    return out


def from_exact_steps(directory: Path) -> dict:
    """A checkpoint of the exact offloaded step (4 steps) resumed with selective updates: each column's count goes on
    from the optimizer's ``step``, so Adam's bias correction does not start over."""
    L.seed_everything(7)
    first = trainer(ZeroStrategy(stage=2, offload_optimizer=True), max_steps=4, **COMMON)
    first.fit(models.Regression(), models.loader(DATA, 4))
    path = first.strategy.broadcast(str(directory / "exact_steps"))
    first.save_checkpoint(path)
    L.seed_everything(7)
    second = trainer(ZeroStrategy(stage=2, **selective(2, 2)), max_steps=6, **COMMON)
    second.fit(models.Regression(), models.loader(DATA, 4), ckpt_path=path)
    state = second.strategy.engine.selective_state()
    counts = torch.cat([entry["column_steps"] for entry in state.values()])
    return {
        "steps": second.global_step,
        "fewest_column_steps": counts.min().item(),
        "most_column_steps": counts.max().item(),
        "finite": all(bool(torch.isfinite(v).all()) for v in second.strategy.full_state_dict().values()),
    }


CASES = {
    "exact": lambda _: exactness(),
    "from_exact_steps": from_exact_steps,
    "growth": lambda _: growth(),
    "edges": lambda _: edges(),
    "checkpoint": checkpoints,
    "save_mid_interval": save_mid_interval,
    "resume_in_other_world": resume_in_other_world,
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
