"""Rank program for the no-hang tests: one fault per launch (a fault ends processes), run through a real
``Trainer`` with a short ``timeout``. ``python -m tests.distributed.worker_hangs CASE``.

The faulty rank writes the time of its fault to ``$LZ_FAULT_FILE`` (see ``tests/launch.py``), so the test
measures how long every rank took to end after it. Rank 1 is the faulty rank unless the case says otherwise.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import lightning as L
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.faults import extended
from tests.distributed import models
from tests.distributed.worker_core import RANK, trainer
from tests.launch import write_report

TIMEOUT = float(os.environ.get("LZ_TIMEOUT", "8"))
FAULT_BATCH = 2
FAULTY = int(os.environ.get("LZ_FAULTY", "1"))


def fault() -> None:
    """Announce the fault (its time) to the harness. Several ranks may announce at once (``generate``), so each
    writes a file of its own and renames it into place: the harness reads one whole announcement, never two
    interleaved."""
    path = os.environ["LZ_FAULT_FILE"]
    with open(f"{path}.{RANK}", "w") as f:
        f.write(f"{time.time()}\n")
    os.replace(f"{path}.{RANK}", path)


def here(batch_idx: int, rank: int = FAULTY) -> bool:
    return RANK == rank and batch_idx == FAULT_BATCH


class Faulty(models.Regression):
    """The test model with a fault chosen by ``case`` at batch 2 of the faulty rank."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.extra = nn.Sequential(nn.Linear(models.IN, models.IN)) if case == "rank_only_submodule" else None
        # Experts of one size, each a stage-3 unit of its own (``nn.Sequential``, unit_size_mb=0): every rank routes
        # to expert 0 until batch 2, where the faulty rank routes to expert 1.
        self.experts = (
            nn.ModuleList([nn.Sequential(nn.Linear(models.IN, models.IN)) for _ in range(2)])
            if case == "experts_as_units"
            else None
        )

    def training_step(self, batch, batch_idx):
        case = self.case
        if here(batch_idx):
            if case == "raise_step":
                fault()
                raise ValueError(f"boom from rank {RANK} at batch {batch_idx}")
            if case == "sigkill":
                fault()
                os.kill(os.getpid(), signal.SIGKILL)
            if case == "sigstop":
                fault()
                os.kill(os.getpid(), signal.SIGSTOP)
            if case == "raise_and_sleep":  # NCCL's semantics on gloo: the failed rank stays alive, sockets open
                fault()
                raise ValueError(f"boom from rank {RANK} at batch {batch_idx}")
            if case == "sleep_forever":
                torch.distributed.barrier()  # both ranks are in batch 2 (see rank 0's side below)
                time.sleep(3600)
        if case == "sleep_forever" and here(batch_idx, rank=0):
            # Announced once both ranks are in batch 2, rank 1 about to sleep and rank 0 before the reduce-scatter it
            # will wait in: the SIGTERM the harness then sends acts only at the next batch boundary, which neither
            # reaches. (Announced by rank 1 alone, it could reach rank 0 still in batch 1, which then stopped at
            # the boundary instead of waiting.)
            torch.distributed.barrier()
            fault()
        if case == "sigstop0" and here(batch_idx, rank=0):
            fault()
            os.kill(os.getpid(), signal.SIGSTOP)
        if case == "sigterm_healthy":
            if here(batch_idx, rank=0):
                fault()  # the harness sends SIGTERM to every rank now
            time.sleep(0.2)
        if case == "slow" and RANK == FAULTY:
            time.sleep(0.6 * TIMEOUT)  # far slower than rank 0, each wait still below the timeout
        x, y = batch
        if self.experts is not None:
            if here(batch_idx):
                fault()
            x = x + self.experts[1 if here(batch_idx) else 0](x)
        if self.extra is not None and here(batch_idx):
            fault()
            x = x + self.extra(x)  # a stage-3 unit only this rank uses: its all-gather has no partner
        loss = nn.functional.mse_loss(self(x), y)
        if case == "conditional_log" and here(batch_idx, rank=0):
            fault()
            self.log("only_rank0", loss, sync_dist=True)  # an all_reduce the other rank never issues
        if case == "raise_backward" and here(batch_idx):

            def explode(grad):
                fault()
                raise RuntimeError(f"boom in backward on rank {RANK}")

            loss.register_hook(explode)
        return loss

    def configure_optimizers(self):
        if self.case != "raise_optimizer":
            return super().configure_optimizers()
        opt, sched = models.make_optimizer(self)
        step = opt.step

        def failing_step(*args, **kwargs):
            if RANK == FAULTY and self.trainer.global_step == FAULT_BATCH:
                fault()
                raise RuntimeError(f"boom in optimizer.step on rank {RANK}")
            return step(*args, **kwargs)

        opt.step = failing_step
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        if self.case == "raise_save" and RANK == FAULTY:
            fault()
            raise OSError(f"boom in on_save_checkpoint on rank {RANK}")


class SkipsAStep(models.Regression):
    """Manual optimization where one rank skips a step's backward and optimizer step (and so their collectives),
    as code that skips on a non-finite loss might: the others wait in a reduce-scatter it never issues."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if here(batch_idx):
            fault()
            return loss
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class FaultyCallback(L.Callback):
    def __init__(self, case: str) -> None:
        self.case = case

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.case == "raise_callback" and here(batch_idx):
            fault()
            raise KeyError(f"boom in a callback on rank {RANK}")
        if self.case == "one_sided" and batch_idx == FAULT_BATCH:
            with extended(3 * TIMEOUT, "rank 0 evaluates alone"):
                if RANK == 0:
                    time.sleep(1.5 * TIMEOUT)  # longer than the timeout: fine inside `extended`
        if self.case == "raise_save" and batch_idx == FAULT_BATCH:
            trainer.save_checkpoint(os.path.join(os.path.dirname(os.environ["LZ_FAULT_FILE"]), "ckpt"))
        if self.case == "save_on_rank0" and batch_idx == FAULT_BATCH and trainer.is_global_zero:
            fault()  # a save under `if trainer.is_global_zero:`, as single-process habits write it
            trainer.save_checkpoint(os.path.join(os.path.dirname(os.environ["LZ_FAULT_FILE"]), "ckpt"))


def fit(case: str, stage: int = 2, **trainer_kwargs) -> None:
    L.seed_everything(7)
    data = models.IndexedData(n=64)
    loader = models.loader(data, 4)
    if case == "uneven":  # rank 1 has half the batches: its own data, no DistributedSampler
        subset = torch.utils.data.Subset(data, range(0, 32 if RANK == 0 else 16))
        loader = torch.utils.data.DataLoader(subset, batch_size=4)
        trainer_kwargs.update(use_distributed_sampler=False, max_epochs=1)
    trainer_kwargs.setdefault("max_steps", {"slow": 3, "sigterm_healthy": 200}.get(case, 6))
    strategy = ZeroStrategy(
        stage=stage,
        timeout=TIMEOUT,
        watchdog=os.environ.get("LZ_WATCHDOG", "1") == "1",
        **({"wrap_policy": nn.Sequential} if stage == 3 else {}),
        **({"unit_size_mb": 0} if case == "experts_as_units" else {}),
    )
    t = trainer(strategy, callbacks=[FaultyCallback(case)], **trainer_kwargs)
    t.fit(SkipsAStep() if case == "skip_step" else Faulty(case), loader)


def pipelined_kill() -> None:
    """Pipeline x ZeRO-3, 2 stages: the rank of the last stage is killed in its loss at batch 2, while rank 0
    waits for its input gradients."""
    from tests.distributed.pipeline_chain import Chain

    class Killed(Chain):
        def pipeline_loss(self, output, target):
            if RANK == FAULTY and self.trainer.global_step == FAULT_BATCH:
                fault()
                os.kill(os.getpid(), signal.SIGKILL)
            return super().pipeline_loss(output, target)

    L.seed_everything(7)
    strategy = ZeroStrategy(stage=3, pipeline_stages=2, microbatches=2, timeout=TIMEOUT)
    trainer(strategy, max_steps=6).fit(Killed(), models.loader(models.IndexedData(n=64), 4))


def generate(synced_gpus: bool | None) -> dict:
    """Validation that calls Hugging Face ``generate()`` with a different length per rank, under stage 3."""
    from tests.distributed.hf_models import HFLightningModule

    lengths = {}

    class Generating(HFLightningModule):
        def validation_step(self, batch, batch_idx):
            x, _ = batch
            if batch_idx == 0 and synced_gpus is False:
                fault()
            out = self.model.generate(
                x[:, :4],
                max_new_tokens=2 + 6 * RANK,
                min_new_tokens=2 + 6 * RANK,
                do_sample=False,
                pad_token_id=0,
                synced_gpus=synced_gpus,
            )
            lengths[batch_idx] = out.shape[1]

    L.seed_everything(7)
    tokens = torch.randint(0, 60, (8, 12), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens, tokens)
    # The whole GPT-2 model is one all-gather unit: every forward pass gathers the same shape, so a rank's extra
    # passes pair silently with the other rank's, as NCCL pairs any shapes (gloo aborts on a size mismatch).
    from transformers import GPT2LMHeadModel

    strategy = ZeroStrategy(stage=3, timeout=TIMEOUT, wrap_policy=GPT2LMHeadModel)
    trainer(strategy, limit_val_batches=2).validate(Generating("gpt2"), torch.utils.data.DataLoader(data, batch_size=2))
    return {"lengths": lengths}


def main(case: str) -> None:
    torch.set_num_threads(1)
    if case == "generate":
        report = {"default": generate(None)}  # per-rank lengths work out of the box (synced_gpus inferred)
        if RANK == 0:
            write_report(report)
        generate(False)  # the user turned synced_gpus off: the ranks run different numbers of forward passes
        return
    if case == "pipelined_kill":
        return pipelined_kill()
    stage = 3 if case in ("rank_only_submodule", "experts_as_units") else 2
    if case == "raise_and_sleep":
        try:
            fit(case, stage)
        except ValueError:
            time.sleep(TIMEOUT + 4)  # alive, sockets open, like a failed NCCL rank nobody noticed
            sys.exit(3)
        return
    fit(case, stage)
    if RANK == 0:
        write_report({"finished": True})


if __name__ == "__main__":
    main(sys.argv[1])
