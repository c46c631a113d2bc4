"""Rank program for the Fabric tests: ``lightning_zero.fabric.ZeroStrategy`` in Fabric loops written the way Fabric's
docs and LitGPT's ``pretrain``/``finetune`` write theirs, against plain single-process PyTorch, the ZeRO memory
formulas, and the ``Trainer`` strategy's checkpoints.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_fabric GROUP...``) on 2 ranks; rank 0 reports. Every
case tears its strategy down (Fabric never does; the pooled processes run later programs).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

import lightning_zero
from lightning_zero import ZeroPrecision
from lightning_zero.demo import GPTLightningModule
from lightning_zero.demo.data import RandomTokenDataset
from lightning_zero.fabric import ZeroStrategy
from tests.distributed import models
from tests.distributed.mixed_reference import mixed_reference
from tests.distributed.worker_core import RANK, WORLD, live_tensor_bytes, max_diff, trainer
from tests.launch import run_cases_with_directory

GPT_KWARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS, ACCUMULATE, BATCH, CLIP = 3, 2, 2, 0.5


def fabric_for(strategy: ZeroStrategy | str, precision: str = "32-true") -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def sgd_with_schedule(module: torch.nn.Module):
    """SGD with momentum over two param groups (different learning rates) and a warmup schedule: Adam would move an
    element whose gradient cancels to its rounding (an attention key bias) by ``lr`` in either summation order."""
    matrices = [p for p in module.parameters() if p.dim() >= 2]
    vectors = [p for p in module.parameters() if p.dim() < 2]
    optimizer = torch.optim.SGD([{"params": matrices, "lr": 0.2}, {"params": vectors, "lr": 0.1}], momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))


def gpt_data() -> RandomTokenDataset:
    return RandomTokenDataset(
        num_samples=32, block_size=GPT_KWARGS["block_size"], vocab_size=GPT_KWARGS["vocab_size"], seed=5
    )


def reference(initial: dict, microbatches: list, clip: float | None, clip_value: float | None = None) -> dict:
    """Plain single-process training on the same global batches: each step's micro-batches of every rank."""
    model = GPTLightningModule(**GPT_KWARGS)
    model.load_state_dict(initial)
    optimizer, scheduler = sgd_with_schedule(model)
    for step in microbatches:
        for per_rank in step:
            for micro in per_rank:
                (model._loss(micro) / (len(per_rank) * len(step))).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def windows(steps: int, accumulate: int) -> list:
    """Per optimizer step: ``accumulate`` micro-batches, each a list of every rank's."""
    flat = models.global_microbatches(gpt_data(), WORLD, BATCH, steps * accumulate)
    return [[flat[s * accumulate + a] for a in range(accumulate)] for s in range(steps)]


def train_loop(fabric, model, optimizer, scheduler, steps: list, *, sync_control=True, clip=CLIP, clip_value=None):
    """A Fabric loop as Fabric's docs write one: accumulation under ``no_backward_sync``, clipping, a scheduler."""
    norms = []
    for step in steps:
        for i, micro in enumerate(step):
            x, y = micro[fabric.global_rank]
            last = i == len(step) - 1
            with fabric.no_backward_sync(model, enabled=sync_control and not last):
                logits = model(x)
                with fabric.autocast():
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)) / len(step)
                fabric.backward(loss)
        if clip is not None:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=clip)))
        if clip_value is not None:
            fabric.clip_gradients(model, optimizer, clip_val=clip_value)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return norms


def gpt_setup(fabric, joint: bool = True, module_class=GPTLightningModule):
    """The demo GPT built under ``fabric.init_module(empty_init=True)`` (on the meta device at stage 3), set up with its
    optimizer (``joint``) or before it."""
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        module = module_class(**GPT_KWARGS)
    # As LitGPT's `initialize_weights` does where the strategy is not Fabric's FSDP: empty memory at stages 1-2 gets
    # its values here; on the meta device (stage 3) this does nothing, and sharding runs the same initialisers.
    for layer in module.modules():
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    if joint:
        optimizer, scheduler = sgd_with_schedule(module)
        model, optimizer = fabric.setup(module, optimizer)
    else:
        model = fabric.setup_module(module)
        optimizer, scheduler = sgd_with_schedule(model)
        optimizer = fabric.setup_optimizers(optimizer)
    return model, optimizer, scheduler


def run_scale(optimizer, steps: int) -> dict:
    """The largest learning rate over ``1 - momentum`` (SGD's velocity sums that many steps), and the steps: what a
    reordered-fp32 bound is derived from (``tests/tolerances.py``)."""
    lr = max(max(g.get("initial_lr", 0.0), g["lr"]) / (1 - g.get("momentum", 0.0)) for g in optimizer.param_groups)
    return {"lr": lr, "steps": steps}


def exact_case(stage: int, offload: bool = False, joint: bool = True, discarded: bool = False, **loop) -> dict:
    """``discarded``: first a backward whose gradients the loop drops with ``optimizer.zero_grad()`` without a step
    (a skipped batch); the training after it must not see them."""
    fabric = fabric_for(ZeroStrategy(stage=stage, offload_optimizer=offload))
    model, optimizer, scheduler = gpt_setup(fabric, joint)
    initial = fabric.strategy.full_state_dict()
    steps = windows(STEPS, ACCUMULATE)
    if discarded:  # unreduced (under no_backward_sync): stage 3 holds them whole outside the shards
        x, y = windows(STEPS + 1, 1)[STEPS][0][fabric.global_rank]
        with fabric.no_backward_sync(model):
            fabric.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()) * 10)
        optimizer.zero_grad()
    train_loop(fabric, model, optimizer, scheduler, steps, **loop)
    final = fabric.strategy.full_state_dict()
    out = run_scale(optimizer, STEPS)
    if RANK == 0:
        expected = reference(initial, steps, loop.get("clip", CLIP), loop.get("clip_value"))
        out["diff"] = max_diff(final, expected)
        out["change"] = max_diff(initial, expected)
    fabric.strategy.teardown()
    return out


def mixed_case(stage: int, precision: str) -> dict:
    """``bf16-mixed`` (Fabric's ``precision=``) or ``16-mixed`` with loss scaling (the plugin, as on CPU Lightning
    rewrites ``precision="16-mixed"`` to bf16) against the single-process emulation of a ZeRO mixed-precision run
    (``mixed_reference.py``)."""
    if precision == "16-mixed":
        fabric = L.Fabric(
            accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(stage=stage), plugins=[ZeroPrecision(precision)]
        )
        fabric.launch()
    else:
        fabric = fabric_for(ZeroStrategy(stage=stage), precision=precision)
    model, optimizer, scheduler = gpt_setup(fabric)
    initial = fabric.strategy.full_state_dict()
    steps = windows(STEPS, 1)
    train_loop(fabric, model, optimizer, scheduler, steps)
    final = fabric.strategy.full_state_dict()
    out = run_scale(optimizer, STEPS)
    out["plugin"] = type(fabric.strategy.precision).__name__
    out["precision"] = fabric.strategy.precision.precision
    if RANK == 0:

        class Reference(GPTLightningModule):
            def configure_optimizers(self):
                optimizer, scheduler = sgd_with_schedule(self)
                return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}

        emulated = mixed_reference(
            initial,
            lambda: Reference(**GPT_KWARGS),
            gpt_data(),
            world=WORLD,
            batch=BATCH,
            steps=STEPS,
            clip=CLIP,
            policy=ZeroPrecision(precision).policy(),
            hold_sum_in_param_dtype=stage != 3,
            loss_scale=ZeroPrecision(precision).loss_scale,
        )
        out["diff"] = max_diff(final, emulated["params"])
        out["change"] = max_diff(initial, emulated["params"])
    fabric.strategy.teardown()
    return out


class WideNet(models.Wide):
    """``models.Wide`` with its step as ``forward``, which a Fabric loop calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def memory_case(stage: int) -> dict:
    """Bytes of every live tensor right after the third backward (``models.Wide``, AdamW), as the Trainer test
    measures them."""
    fabric = fabric_for(ZeroStrategy(stage=stage))
    torch.manual_seed(0)
    module = WideNet()
    params = sum(p.numel() for p in module.parameters())
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = models.WideData(module.width)
    measured = None
    for step in range(3):
        x = torch.stack([data[i] for i in range(step * 8, (step + 1) * 8)])
        fabric.backward(model(x).pow(2).mean())
        if step == 2:
            measured = live_tensor_bytes()
        optimizer.step()
        optimizer.zero_grad()
    del model, optimizer, module
    fabric.strategy.teardown()
    return {"bytes": measured, "params": params}


def exactness(directory: Path) -> dict:
    out = {}
    for stage in (1, 2, 3):
        out[f"stage{stage}"] = exact_case(stage)
        out[f"stage{stage}_offload"] = exact_case(stage, offload=True)
    out["stage3_separate_setup"] = exact_case(3, joint=False)
    out["stage2_without_no_backward_sync"] = exact_case(2, sync_control=False)
    out["stage3_clip_value"] = exact_case(3, clip=None, clip_value=0.01)
    for stage in (1, 2, 3):
        out[f"stage{stage}_zero_grad_without_step"] = exact_case(stage, discarded=True)
    out["two_optimizers_fp16"] = two_optimizers_case()
    for stage in (1, 2, 3):
        out[f"bf16_stage{stage}"] = mixed_case(stage, "bf16-mixed")
    out["fp16_stage2"] = mixed_case(2, "16-mixed")
    out["fp16_stage3"] = mixed_case(3, "16-mixed")
    out["overflow"] = overflow_case()
    out["bf16_true"] = bf16_true_case()
    return out


def two_optimizers_case() -> dict:
    """``16-mixed`` with the scale growing every step (``growth_interval=1``), then a step that overflows: the matrices
    and the vectors stepped by two optimizers end bit for bit where one optimizer over both groups ends (each unscales
    by the scale its backward used, and the scale moves once a step, backing off once for both)."""
    finals, scales = [], []
    for split in (False, True):
        plugin = ZeroPrecision("16-mixed", growth_interval=1)
        fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(stage=2), plugins=[plugin])
        fabric.launch()
        torch.manual_seed(0)
        module = GPTLightningModule(**GPT_KWARGS)
        model = fabric.setup_module(module)
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        if split:
            optimizers = [torch.optim.SGD(matrices, lr=0.2), torch.optim.SGD(vectors, lr=0.1)]
        else:
            optimizers = [torch.optim.SGD([{"params": matrices, "lr": 0.2}, {"params": vectors, "lr": 0.1}])]
        optimizers = [fabric.setup_optimizers(o) for o in optimizers]
        for index, step in enumerate(windows(STEPS + 1, 1)):
            x, y = step[0][fabric.global_rank]
            overflow = float("inf") if index == STEPS and fabric.global_rank == 0 else 1.0  # both skip, one back-off
            fabric.backward(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) * overflow)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        finals.append(fabric.strategy.full_state_dict())
        scales.append(plugin.loss_scale)
        fabric.strategy.teardown()
    return {"diff": max_diff(*finals) if RANK == 0 else 0.0, "scales": scales}


def overflow_case() -> dict:
    """``16-mixed``: an inf in rank 0's loss at the second step skips that step on every rank and halves the scale."""
    fabric = L.Fabric(
        accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(stage=2), plugins=[ZeroPrecision("16-mixed")]
    )
    fabric.launch()
    model, optimizer, scheduler = gpt_setup(fabric)
    steps = windows(3, 1)
    train_loop(fabric, model, optimizer, scheduler, steps[:1])
    before, scale = fabric.strategy.full_state_dict(), fabric.strategy.precision.loss_scale
    x, y = steps[1][0][fabric.global_rank]
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    fabric.backward(loss * (float("inf") if fabric.global_rank == 0 else 1.0))
    norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
    optimizer.step()
    optimizer.zero_grad()
    after = fabric.strategy.full_state_dict()
    out = {"scale_before": scale, "scale_after": fabric.strategy.precision.loss_scale, "norm": float(norm)}
    out["unchanged"] = RANK != 0 or max_diff(before, after) == 0.0
    train_loop(fabric, model, optimizer, scheduler, steps[2:])
    final = fabric.strategy.full_state_dict()  # collective
    out["trains_on"] = RANK != 0 or max_diff(after, final) > 0
    fabric.strategy.teardown()
    return out


def bf16_true_case() -> dict:
    """``bf16-true``: the module, its inputs and the optimizer state in bf16, as Lightning's."""
    fabric = fabric_for(ZeroStrategy(stage=3), precision="bf16-true")
    model, optimizer, scheduler = gpt_setup(fabric)
    initial = fabric.strategy.full_state_dict()
    train_loop(fabric, model, optimizer, scheduler, windows(2, 1))
    final = fabric.strategy.full_state_dict()
    dtypes = sorted({str(v.dtype) for v in final.values()}) if RANK == 0 else []
    change = max_diff(initial, final) if RANK == 0 else 0.0
    fabric.strategy.teardown()
    return {"dtypes": dtypes, "change": change}


def memory(directory: Path) -> dict:
    return {f"stage{stage}": memory_case(stage) for stage in (1, 2, 3)}


# ---------------------------------------------------------------------- checkpoints
def _trainer_module() -> GPTLightningModule:
    class Trained(GPTLightningModule):
        def configure_optimizers(self):
            optimizer, scheduler = sgd_with_schedule(self)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    torch.manual_seed(0)
    return Trained(**GPT_KWARGS)


class SaveAtStart(L.Callback):
    """Write the checkpoint a resumed fit starts from, as it loaded it, then stop."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)
        trainer.should_stop = True


def checkpoints(directory: Path) -> dict:
    out = {}
    steps = windows(STEPS, ACCUMULATE)
    # Fabric saves (sharded and full); a Trainer at another stage resumes from the sharded one and writes it full.
    fabric = fabric_for(ZeroStrategy(stage=2))
    model, optimizer, scheduler = gpt_setup(fabric)
    train_loop(fabric, model, optimizer, scheduler, steps[:2])
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2, "note": "fabric"}
    shared = Path(fabric.broadcast(str(directory)))  # rank 0's directory: what a full file's rank 0 wrote is there
    fabric.save(directory / "fabric_sharded", state)
    fabric.strategy.zero_config = lightning_zero.ZeroConfig(stage=2, state_dict_type="full")
    fabric.save(directory / "fabric_full.ckpt", state)
    full_entries = sorted(torch.load(directory / "fabric_full.ckpt", weights_only=True)) if RANK == 0 else []
    fabric.strategy.teardown()
    module = _trainer_module()
    t = trainer(
        lightning_zero.ZeroStrategy(stage=3, state_dict_type="full"),
        max_steps=10,
        callbacks=[SaveAtStart(directory / "trainer_from_fabric.ckpt")],
    )
    t.fit(module, models.loader(gpt_data(), BATCH), ckpt_path=directory / "fabric_sharded")
    module = _trainer_module()  # and from the full file, under the loop's own keys
    t = trainer(
        lightning_zero.ZeroStrategy(stage=1, state_dict_type="full"),
        max_steps=10,
        callbacks=[SaveAtStart(directory / "trainer_from_fabric_full.ckpt")],
    )
    t.fit(module, models.loader(gpt_data(), BATCH), ckpt_path=directory / "fabric_full.ckpt")
    # A Trainer saves (sharded); Fabric at another stage loads it and writes it full.
    module = _trainer_module()
    t = trainer(lightning_zero.ZeroStrategy(stage=1), max_steps=2)
    t.fit(module, models.loader(gpt_data(), BATCH))
    t.save_checkpoint(directory / "trainer_sharded")
    t.strategy.zero_config = lightning_zero.ZeroConfig(stage=1, state_dict_type="full")
    t.save_checkpoint(directory / "trainer_full.ckpt")
    fabric = fabric_for(ZeroStrategy(stage=3, state_dict_type="full"))
    model, optimizer, scheduler = gpt_setup(fabric)
    remainder = fabric.load(directory / "trainer_sharded", {"model": model, "optimizer": optimizer})
    fabric.save(directory / "fabric_from_trainer.ckpt", {"model": model, "optimizer": optimizer})
    # The loop's own entries come back; a full file loads into a fresh loop, and a plain state dict with load_raw.
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0, "note": ""}
    fabric_remainder = fabric.load(directory / "fabric_full.ckpt", state)
    out["restored_entries"] = {"step": state["step"], "note": state["note"], "remainder": sorted(fabric_remainder)}
    out["scheduler_epoch"] = scheduler.last_epoch
    raw = directory / "raw.pt"
    if RANK == 0:
        torch.save({k: torch.full_like(v, 0.5) for k, v in _trainer_module().state_dict().items()}, raw)
    fabric.barrier()
    fabric.load_raw(raw, model)
    out["raw_loaded"] = all(bool((v == 0.5).all()) for v in fabric.strategy.full_state_dict().values())
    fabric.strategy.teardown()
    # async_save: the loop goes on while the checkpoint is written; the next save (or teardown) waits for it.
    fabric = fabric_for(ZeroStrategy(stage=2, async_save=True))
    model, optimizer, scheduler = gpt_setup(fabric)
    saved = []
    for step in range(2):  # the first save is written while the second step trains
        train_loop(fabric, model, optimizer, scheduler, steps[step : step + 1])
        saved.append(fabric.strategy.full_state_dict())
        fabric.save(directory / f"async_{step}", {"model": model, "optimizer": optimizer, "step": step + 1})
    fabric.strategy.teardown()
    out["async_save"] = []
    for step in range(2):
        fabric = fabric_for(ZeroStrategy(stage=3))
        model, optimizer, scheduler = gpt_setup(fabric)
        entries = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(directory / f"async_{step}", entries)
        loaded = fabric.strategy.full_state_dict()
        out["async_save"].append({"step": entries["step"], "diff": max_diff(saved[step], loaded) if RANK == 0 else 0.0})
        fabric.strategy.teardown()
    # init_weights= reads a Fabric loop's full file (the module under the loop's key) row by row into stage 3's shards.
    fabric = fabric_for(ZeroStrategy(stage=3, init_weights=shared / "fabric_full.ckpt"))
    model, optimizer, scheduler = gpt_setup(fabric)
    initial = fabric.strategy.full_state_dict()
    fabric.strategy.teardown()
    if RANK == 0:
        saved_model = torch.load(directory / "fabric_full.ckpt", weights_only=True)["model"]
        out["init_weights_from_fabric_file"] = max_diff(initial, saved_model)
    out["optimizers_by_key"] = optimizers_by_key(directory)
    out["buffers"] = buffers_case()
    if RANK == 0:
        out["full_file_entries"] = full_entries
        out["trainer_remainder"] = sorted(remainder)
        out["fabric_to_trainer"] = _same_states(directory / "fabric_full.ckpt", directory / "trainer_from_fabric.ckpt")
        out["fabric_full_to_trainer"] = _same_states(
            directory / "fabric_full.ckpt", directory / "trainer_from_fabric_full.ckpt"
        )
        out["trainer_to_fabric"] = _same_states(directory / "trainer_full.ckpt", directory / "fabric_from_trainer.ckpt")
    return out


def _two_optimizer_setup(fabric):
    torch.manual_seed(0)
    module = GPTLightningModule(**GPT_KWARGS)
    model = fabric.setup_module(module)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    first = fabric.setup_optimizers(torch.optim.SGD(matrices, lr=0.2, momentum=0.9))
    second = fabric.setup_optimizers(torch.optim.SGD(vectors, lr=0.1, momentum=0.5))
    return model, first, second


def optimizers_by_key(directory: Path) -> dict:
    """Two optimizers saved as ``matrices`` and ``vectors`` load back by key from a dictionary listing them the
    other way round, at another stage; a dictionary naming only the second is refused before anything loads."""
    fabric = fabric_for(ZeroStrategy(stage=2))
    model, first, second = _two_optimizer_setup(fabric)
    x, y = windows(1, 1)[0][0][fabric.global_rank]
    fabric.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    first.step()
    second.step()
    fabric.save(directory / "two_optimizers", {"model": model, "matrices": first, "vectors": second})
    rates = [[float(g["lr"]) for g in o.param_groups] for o in (first, second)]
    fabric.strategy.teardown()
    fabric = fabric_for(ZeroStrategy(stage=3))
    model, first, second = _two_optimizer_setup(fabric)
    for group in (*first.param_groups, *second.param_groups):
        group["lr"] = 0.0  # the load must bring each optimizer its own hyperparameters
    fabric.load(directory / "two_optimizers", {"model": model, "vectors": second, "matrices": first})
    loaded = [[float(g["lr"]) for g in o.param_groups] for o in (first, second)]
    refused = _error(lambda: fabric.load(directory / "two_optimizers", {"model": model, "vectors": second}))
    fabric.strategy.teardown()
    return {"saved": rates, "loaded": loaded, "subset": refused}


class NormedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def buffers_case() -> dict:
    """BatchNorm's running statistics, updated by each rank's own batch, are rank 0's on every rank after a step."""
    fabric = fabric_for(ZeroStrategy(stage=2))
    torch.manual_seed(0)
    model = fabric.setup_module(NormedNet())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(fabric.global_rank)) * (1 + fabric.global_rank)
    fabric.backward(model(x).pow(2).mean())
    optimizer.step()
    mean = model.blocks[1].running_mean.clone()
    gathered = fabric.all_gather(mean)
    fabric.strategy.teardown()
    return {"same_on_every_rank": bool((gathered[0] == gathered[1]).all()), "moved": float(mean.abs().max())}


def _same_states(a: Path, b: Path) -> dict:
    """The module's and the first optimizer's tensors of two full checkpoints (either layout), compared."""
    from lightning_zero.checkpoint.verify import read_checkpoint_dict

    first, second = read_checkpoint_dict(a), read_checkpoint_dict(b)
    tensors = {}
    for name, checkpoint in (("a", first), ("b", second)):
        state = {"state_dict": checkpoint["state_dict"], "optimizer": checkpoint["optimizer_states"][0]["state"]}
        tensors[name] = models._tensors(state)
    same_names = sorted(tensors["a"]) == sorted(tensors["b"])
    diff = max((tensors["a"][k].double() - tensors["b"][k].double()).abs().max().item() for k in tensors["a"])
    return {"names": same_names, "tensors": len(tensors["a"]), "max_diff": diff}


# ---------------------------------------------------------------------- kill and resume
KILL_STEPS = 4


class DropoutGPT(GPTLightningModule):
    """The demo GPT with dropout: a resumed run draws the masks the uninterrupted one draws only if the checkpoint
    brought back each rank's RNG state."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs, dropout=0.2)


def _resumable_loop(fabric, directory: Path, stop_after: int | None) -> dict:
    """Save after every step; ``stop_after``: every rank is killed (SIGKILL) inside the next step, after its first
    forward."""
    model, optimizer, scheduler = gpt_setup(fabric, module_class=DropoutGPT)
    steps = windows(KILL_STEPS, ACCUMULATE)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    latest = directory / "latest"
    if latest.exists():
        fabric.load(latest, state)
    started_at = state["step"]
    while state["step"] < KILL_STEPS:
        if stop_after is not None and state["step"] == stop_after:  # killed mid-step, between forward and backward
            model(steps[state["step"]][0][fabric.global_rank][0])
            os.kill(os.getpid(), signal.SIGKILL)
        train_loop(fabric, model, optimizer, scheduler, [steps[state["step"]]])
        state["step"] += 1
        fabric.save(latest, state)
    return {"started_at": started_at, "params": {k: v.tolist() for k, v in fabric.strategy.full_state_dict().items()}}


def killed(directory: Path) -> dict:
    return _resumable_loop(fabric_for(ZeroStrategy(stage=3)), directory, stop_after=2)


def resumed(directory: Path) -> dict:
    fabric = fabric_for(ZeroStrategy(stage=3))
    out = _resumable_loop(fabric, directory, stop_after=None)
    fabric.strategy.teardown()
    return out


def uninterrupted(directory: Path) -> dict:
    fabric = fabric_for(ZeroStrategy(stage=3))
    out = _resumable_loop(fabric, directory / "uninterrupted", stop_after=None)
    fabric.strategy.teardown()
    return out


# ---------------------------------------------------------------------- LitGPT
LITGPT = dict(
    n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64, bias=True, rotary_percentage=1.0
)


def litgpt_batches(steps: int, accumulate: int) -> list:
    """Per optimizer step, per micro-batch, every rank's ``(B, T + 1)`` token rows (LitGPT splits inputs and targets)."""
    tokens = torch.randint(0, LITGPT["vocab_size"], (steps * accumulate * WORLD * BATCH, LITGPT["block_size"] + 1))
    rows = tokens.view(steps, accumulate, WORLD, BATCH, -1)
    return [[list(rows[s, a]) for a in range(accumulate)] for s in range(steps)]


def litgpt_loss(model, rows: torch.Tensor) -> torch.Tensor:
    from litgpt.utils import chunked_cross_entropy

    input_ids, targets = rows[:, :-1], rows[:, 1:]
    return chunked_cross_entropy(model(input_ids), targets)


def litgpt_reference(model_class, config, initial: dict, batches: list, clip: float, trainable=None) -> dict:
    torch.manual_seed(0)
    model = model_class(config)
    model.load_state_dict(initial)
    if trainable is not None:
        trainable(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in batches:
        for micro in step:
            for rows in micro:
                (litgpt_loss(model, torch.stack(list(rows))) / (len(micro) * len(step))).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def litgpt_loop(fabric, model, optimizer, batches: list, clip: float) -> None:
    """LitGPT's ``pretrain``/``finetune`` step: accumulation under ``no_backward_sync``, ``chunked_cross_entropy``,
    ``fabric.clip_gradients`` by norm."""
    for step in batches:
        for i, micro in enumerate(step):
            with fabric.no_backward_sync(model, enabled=i < len(step) - 1):
                loss = litgpt_loss(model, torch.stack(list(micro[fabric.global_rank])))
                fabric.backward(loss / len(step))
        fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()


def litgpt_pretrain(stage: int) -> dict:
    """LitGPT's ``pretrain`` set-up: ``init_module(empty_init=True)``, ``initialize_weights`` (for a strategy other
    than Fabric's FSDP it resets the parameters itself; on the meta device that does nothing, and stage 3's sharding
    runs the same initialisers), ``fabric.setup(model)``, then the optimizer. The rope cache is a non-persistent
    buffer the meta build must rebuild."""
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights

    fabric = fabric_for(ZeroStrategy(stage=stage))
    config = Config(**LITGPT)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    initial = fabric.strategy.full_state_dict()
    torch.manual_seed(1)
    batches = litgpt_batches(STEPS, ACCUMULATE)
    litgpt_loop(fabric, model, optimizer, batches, clip=1.0)
    final = fabric.strategy.full_state_dict()
    out = {"lr": 0.1 / (1 - 0.9), "steps": STEPS}
    if RANK == 0:
        expected = litgpt_reference(GPT, config, initial, batches, clip=1.0)
        out["diff"], out["change"] = max_diff(final, expected), max_diff(initial, expected)
    fabric.strategy.teardown()
    return out


def litgpt_lora(stage: int, directory: Path) -> dict:
    """LitGPT's ``finetune/lora`` set-up: pretrained weights read with ``fabric.load_raw(..., strict=False)`` into a LoRA
    model whose base weights are frozen, the trainable LoRA weights alone saved with ``lora_filter``."""
    from litgpt.lora import GPT, Config, lora_filter, mark_only_lora_as_trainable

    fabric = fabric_for(ZeroStrategy(stage=stage, state_dict_type="full"))
    config = Config(**LITGPT, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_mlp=True)
    pretrained = directory / f"pretrained{stage}.pt"
    if RANK == 0:
        torch.manual_seed(2)
        base = GPT(config)
        torch.save({k: v for k, v in base.state_dict().items() if "lora_" not in k}, pretrained)
    fabric.barrier()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    for layer in model.modules():  # LoRA's A and B (empty memory at stages 1-2; stage 3 initialises as it shards)
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    )
    fabric.load_raw(pretrained, model, strict=False)
    initial = fabric.strategy.full_state_dict()
    torch.manual_seed(1)
    batches = litgpt_batches(STEPS, ACCUMULATE)
    litgpt_loop(fabric, model, optimizer, batches, clip=1.0)
    final = fabric.strategy.full_state_dict()
    saved = directory / f"lora{stage}.pth"
    fabric.save(saved, {"model": model}, filter={"model": lora_filter})
    out = {"lr": 0.1 / (1 - 0.9), "steps": STEPS}
    if RANK == 0:
        base = torch.load(pretrained, weights_only=True)
        out["base_loaded"] = max_diff({k: initial[k] for k in base}, base) == 0.0
        expected = litgpt_reference(GPT, config, initial, batches, clip=1.0, trainable=mark_only_lora_as_trainable)
        out["diff"], out["change"] = max_diff(final, expected), max_diff(initial, expected)
        out["frozen_unchanged"] = max_diff({k: final[k] for k in base}, base) == 0.0
        lora = torch.load(saved, weights_only=True)["model"]
        out["saved_lora_only"] = bool(lora) and all("lora_" in k for k in lora)
        out["saved_lora_diff"] = max_diff(lora, {k: final[k] for k in lora})
    fabric.strategy.teardown()
    return out


def litgpt(directory: Path) -> dict:
    out = {f"pretrain_stage{stage}": litgpt_pretrain(stage) for stage in (1, 2, 3)}
    out.update({f"lora_stage{stage}": litgpt_lora(stage, directory) for stage in (1, 2, 3)})
    return out


def reused_optimizer() -> str:
    """A module and optimizer set up, torn down, and set up again in a new Fabric train there as before."""
    torch.manual_seed(0)
    module = GPTLightningModule(**GPT_KWARGS)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    x, y = windows(1, 1)[0][0][RANK]
    for _ in range(2):
        fabric = fabric_for(ZeroStrategy(stage=2))
        model, wrapped = fabric.setup(module, optimizer)
        fabric.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        wrapped.step()
        wrapped.zero_grad()
        fabric.strategy.teardown()
    return "trained twice"


def loop_skips_overflow() -> dict:
    """``16-mixed``: the loop sees a non-finite norm and drops the gradients with ``zero_grad`` instead of stepping;
    the scale backs off all the same."""
    fabric = L.Fabric(
        accelerator="cpu", devices=WORLD, strategy=ZeroStrategy(stage=2), plugins=[ZeroPrecision("16-mixed")]
    )
    fabric.launch()
    model, optimizer, scheduler = gpt_setup(fabric)
    x, y = windows(1, 1)[0][0][fabric.global_rank]
    before = fabric.strategy.precision.loss_scale
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    fabric.backward(loss * (float("inf") if fabric.global_rank == 0 else 1.0))
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
    if not torch.isfinite(norm):
        optimizer.zero_grad()
    after = fabric.strategy.precision.loss_scale
    fabric.strategy.teardown()
    return {"before": before, "after": after}


# ---------------------------------------------------------------------- errors
def _error(call) -> str:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        return f"{type(err).__name__}: {err}"
    return "no error"


def errors(directory: Path) -> dict:
    """Misuse inside a launched loop, on every rank alike: each fails at once, naming the fix."""
    out = {}
    fabric = fabric_for(ZeroStrategy(stage=3))
    out["optimizer_before_module"] = _error(
        lambda: fabric.setup_optimizers(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    )
    model, optimizer, scheduler = gpt_setup(fabric)
    out["second_module"] = _error(lambda: fabric.setup(torch.nn.Linear(2, 2)))
    out["foreign_parameters"] = _error(
        lambda: fabric.setup_optimizers(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    )
    x, y = windows(1, 1)[0][0][fabric.global_rank]
    fabric.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    out["norm_type"] = _error(lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type="inf"))
    fabric.backward(model(x).sum() * float("nan"))
    out["nonfinite_norm"] = _error(lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0))
    optimizer.zero_grad()
    out["save_without_module"] = _error(lambda: fabric.save(directory / "nothing", {"optimizer": optimizer}))
    out["save_reserved_key"] = _error(lambda: fabric.save(directory / "r", {"model": model, "state_dict": 1}))
    out["save_optimizer_filter"] = _error(
        lambda: fabric.save(directory / "f", {"model": model, "optimizer": optimizer}, filter={"optimizer": all})
    )
    fabric.save(directory / "errors_sharded", {"model": model})
    out["load_directory_without_objects"] = _error(lambda: fabric.load(directory / "errors_sharded"))
    out["load_missing_entry_strict"] = _error(
        lambda: fabric.load(directory / "errors_sharded", {"model": model, "optimizer": optimizer})
    )
    out["load_missing_entry_not_strict"] = _error(
        lambda: fabric.load(directory / "errors_sharded", {"model": model, "optimizer": optimizer}, strict=False)
    )
    out["load_unsafe"] = _error(lambda: fabric.load(directory / "errors_sharded", {"model": model}, weights_only=False))
    out["reused_optimizer"] = reused_optimizer()
    out["loop_skips_overflow"] = loop_skips_overflow()
    rank = torch.tensor(float(fabric.global_rank + 1))
    out["all_reduce_mean"] = float(fabric.all_reduce(rank))
    out["all_reduce_sum"] = float(fabric.all_reduce(rank, reduce_op="sum"))
    out["broadcast"] = fabric.broadcast(f"from rank {fabric.global_rank}", src=1)
    fabric.strategy.teardown()
    return out


# ---------------------------------------------------------------------- faults
def rank_fails(directory: Path) -> dict:
    """Rank 1 raises inside the second step, before its backward; rank 0 goes on into the gradient reduction."""
    fabric = fabric_for(ZeroStrategy(stage=2, timeout=10))
    model, optimizer, scheduler = gpt_setup(fabric)
    steps = windows(2, 1)
    train_loop(fabric, model, optimizer, scheduler, steps[:1])
    if fabric.global_rank == 1:
        raise RuntimeError("the data loader of rank 1 failed")
    train_loop(fabric, model, optimizer, scheduler, steps[1:])
    return {}


CASES = {
    "rank_fails": rank_fails,
    "errors": errors,
    "litgpt": litgpt,
    "exactness": exactness,
    "memory": memory,
    "checkpoints": checkpoints,
    "killed": killed,
    "resumed": resumed,
    "uninterrupted": uninterrupted,
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
