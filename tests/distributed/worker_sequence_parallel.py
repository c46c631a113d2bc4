"""Rank program for the sequence-parallelism tests: ``ZeroStrategy(sequence_parallel_size=2)`` inside
``lightning.Trainer`` against plain single-process PyTorch on the whole sequences.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_sequence_parallel GROUP``) on 2 ranks (one group of
2) or 4 (2 groups of 2, data-parallel 2); rank 0 reports.
"""

from __future__ import annotations

import copy
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from lightning_zero import ZeroStrategy
from lightning_zero.demo import GPTLightningModule
from lightning_zero.demo.gpt import Block
from lightning_zero.sequence_parallel import group_mean, positions
from tests.distributed import hf_models, models
from tests.distributed.worker_core import RANK, WORLD, max_diff, run_scale, trainer
from tests.launch import run_cases

SIZE = 2  # ranks per sequence-parallel group
STEPS, ACCUMULATE, CLIP = 3, 2, 0.5
GPT_SEQUENCE, GPT_VOCAB = 32, 32


class LossRecorder(L.Callback):
    """The loss each training step returned (the group's, for a Hugging Face causal LM)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def gpt_samples() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = [
        torch.randint(0, GPT_VOCAB, (GPT_SEQUENCE + 1,), generator=torch.Generator().manual_seed(i)) for i in range(32)
    ]
    return [(t[:-1], t[1:]) for t in tokens]


class GPT(GPTLightningModule):
    """The demo GPT with SGD over two param groups (different learning rates) and a warmup schedule: Adam would move
    an element whose gradient cancels to its rounding by ``lr`` in either summation order (``tests/tolerances.py``)."""

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "lr": 0.2}, {"params": vectors, "lr": 0.1}]
        optimizer = torch.optim.SGD(groups, lr=0.2, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class GroupMeanGPT(GPT):
    """Its loss the mean over the tokens that count, through ``sequence_parallel.group_mean``: each rank's sum over
    its positions and how many count there, which differ between the ranks (the masked positions lie in one half)."""

    def _loss(self, batch):
        x, y = batch
        logits = self(x)
        total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100, reduction="sum")
        return group_mean(total, (y != -100).sum())


def gpt_module() -> GPT:
    return GPT(vocab_size=GPT_VOCAB, block_size=GPT_SEQUENCE, n_layer=2, n_head=4, n_embd=16)


def reference(module: L.LightningModule, samples: list, batch: int, loss, size: int = SIZE) -> tuple[dict, list[float]]:
    """Plain single-process PyTorch on the whole sequences: the replicas' micro-batches averaged, accumulated,
    clipped by the global norm, then the optimizer and its scheduler; the micro-batch losses it saw."""
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured["lr_scheduler"]["scheduler"] if isinstance(configured, dict) else None
    # the micro-batches each data-parallel replica reads, as Lightning deals them
    micro = models.global_microbatches(samples, WORLD // size, batch, STEPS * ACCUMULATE, default_collate)
    losses = []
    for step in range(STEPS):
        for m in range(ACCUMULATE):
            replicas = micro[step * ACCUMULATE + m]
            value = sum(loss(module, b) for b in replicas) / len(replicas)
            losses.append(value.item())
            (value / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, losses


def fit(
    module: L.LightningModule, samples: list, batch: int, stage: int | None, loader=None, **strategy_kwargs
) -> tuple[L.Trainer, dict, list]:
    """``stage`` None: the stage and the size come from ``config=`` alone. ``loader``: the user's own DataLoader
    (Lightning then makes no sampler)."""
    recorder = LossRecorder()
    if stage is not None:
        strategy_kwargs.update(stage=stage, sequence_parallel_size=strategy_kwargs.get("sequence_parallel_size", SIZE))
    strategy = ZeroStrategy(state_dict_type="full", **strategy_kwargs)
    t = trainer(
        strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        limit_val_batches=0,
        callbacks=[recorder],
        use_distributed_sampler=loader is None,
    )
    t.fit(module, loader or torch.utils.data.DataLoader(samples, batch_size=batch))
    return t, t.strategy.full_state_dict(), recorder.losses


def compare(module: L.LightningModule, initial: dict, samples, batch, loss, t, final, losses) -> dict:
    out = {**run_scale(t), "sampler": t.distributed_sampler_kwargs}
    if RANK == 0:
        module.load_state_dict(initial)
        size = t.strategy.zero_config.sequence_parallel_size
        expected, expected_losses = reference(module, samples, batch, loss, size)
        out["param_diff"] = max_diff(final, expected)
        out["param_change"] = max_diff(expected, initial)
        out["losses"], out["expected_losses"] = losses, expected_losses
    return out


def group_meaned(stage: int) -> dict:
    """:class:`GroupMeanGPT` on targets whose first 8 positions of every other sample do not count (all in rank 0's
    half), against single process's mean over the tokens that count."""
    L.seed_everything(3)
    module = GroupMeanGPT(vocab_size=GPT_VOCAB, block_size=GPT_SEQUENCE, n_layer=2, n_head=4, n_embd=16)
    initial = copy.deepcopy(module.state_dict())
    samples = [(x, y.clone()) for x, y in gpt_samples()]
    for x, y in samples[::2]:
        y[:8] = -100
    t, final, losses = fit(module, samples, 2, stage)
    reference = GPT(vocab_size=GPT_VOCAB, block_size=GPT_SEQUENCE, n_layer=2, n_head=4, n_embd=16)

    def whole_mean(m, b):
        logits = m(b[0])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), b[1].reshape(-1), ignore_index=-100)

    return compare(reference, initial, samples, 2, whole_mean, t, final, losses)


def gpt(stage: int | None, **strategy_kwargs) -> dict:
    """The demo GPT (positions from ``sequence_parallel.positions``) on sequences of 32 cut in 2."""
    L.seed_everything(3)
    module = gpt_module()
    initial = copy.deepcopy(module.state_dict())
    samples = gpt_samples()
    t, final, losses = fit(module, samples, 2, stage, **strategy_kwargs)
    return compare(gpt_module(), initial, samples, 2, lambda m, b: m._loss(b), t, final, losses)


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM trained as its users write it: the batch's dict goes into the model, which computes
    the loss from unshifted ``labels``."""

    def __init__(self, kind: str = "llama", **config) -> None:
        super().__init__()
        settings = hf_models.tiny_config(kind)
        for key, value in config.items():
            setattr(settings, key, value)
        self.model = hf_models.model_class(kind)(settings)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        # SGD, as the tiled-compute tests: AdamW would move an element whose gradient cancels to its rounding by lr
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def hf_samples(length: int = hf_models.LENGTH, shifted: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf_models.VOCAB, (16, length), generator=g)
    labels = tokens.clone()
    labels[:, :3] = -100  # a prompt the user masked, as equally many positions in every sample
    samples = [{"input_ids": t, "labels": lab} for t, lab in zip(tokens, labels)]
    if shifted:
        for sample in samples:
            sample["shift_labels"] = torch.cat([sample["labels"][1:], torch.tensor([-100])])
    return samples


def llama(stage: int, kind: str = "llama", shifted: bool = False, reentrant: bool = False, **strategy_kwargs) -> dict:
    return fitted_llama(stage, kind, shifted, reentrant, **strategy_kwargs)[0]


def fitted_llama(
    stage: int, kind: str = "llama", shifted: bool = False, reentrant: bool = False, **strategy_kwargs
) -> tuple[dict, CausalLM]:
    """A tiny Llama (4 query heads, 2 key/value heads) on sequences of 12 cut in 2, its loss from masked labels;
    ``shifted``: the batch also holds the labels shifted by the user (``shift_labels``, DeepSpeed-Ulysses' way);
    ``reentrant``: the model's own gradient checkpointing, with torch's reentrant checkpoint."""
    L.seed_everything(5)
    module = CausalLM(kind)
    if reentrant:
        module.model.gradient_checkpointing_enable({"use_reentrant": True})
    initial = copy.deepcopy(module.state_dict())
    samples = hf_samples(shifted=shifted)
    t, final, losses = fit(module, samples, 2, stage, **strategy_kwargs)
    out = compare(CausalLM(kind), initial, samples, 2, lambda m, b: m.model(**b).loss, t, final, losses)
    out["attention_after_fit"] = module.model.config._attn_implementation
    out["hooks_after_fit"] = len(module.model._forward_pre_hooks) + len(module.model._forward_hooks)
    return out, module


def validated(stage: int) -> dict:
    """The Llama fitted, then ``trainer.validate`` under sequence parallelism: the logged loss is the whole
    sequences' mean, as single-process PyTorch computes it with the same weights."""
    _, module = fitted_llama(stage)  # at stage 2 every rank holds the trained weights after fit
    samples = hf_samples()[:8]
    strategy = ZeroStrategy(stage=stage, sequence_parallel_size=SIZE)
    metrics = trainer(strategy).validate(module, torch.utils.data.DataLoader(samples, batch_size=2), verbose=False)
    batches = [torch.utils.data.default_collate(samples[i : i + 2]) for i in range(0, len(samples), 2)]
    with torch.no_grad():
        expected = sum(module.model(**b).loss.item() for b in batches) / len(batches)
    return {"val_loss": metrics[0]["val_loss"], "expected_val_loss": expected}


class ForwardOnRankZero(L.Callback):
    """After the first step, rank 0 alone runs the model on a whole sequence (as a callback that samples text does):
    outside the steps the wired model is plain, so nothing waits for the other rank."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0 and trainer.global_rank == 0:
            with torch.no_grad():
                ids = torch.arange(hf_models.LENGTH)[None] % hf_models.VOCAB
                self.shape = list(module.model(input_ids=ids).logits.shape)


def rank_zero_forward(stage: int) -> dict:
    L.seed_everything(5)
    probe = ForwardOnRankZero()
    strategy = ZeroStrategy(stage=stage, sequence_parallel_size=SIZE)
    trainer(strategy, max_steps=2, limit_val_batches=0, callbacks=[probe]).fit(
        CausalLM(), torch.utils.data.DataLoader(hf_samples(), batch_size=2)
    )
    return {"shape": getattr(probe, "shape", None)}


def predicted(stage: int) -> dict:
    """``trainer.predict`` over 9 samples: Lightning's predict sampler deals the 2 replicas 5 and 4, so the groups
    see different numbers of batches (each group's ranks the same)."""
    L.seed_everything(3)
    strategy = ZeroStrategy(stage=stage, sequence_parallel_size=SIZE)
    out = trainer(strategy).predict(gpt_module(), torch.utils.data.DataLoader(gpt_samples()[:9], batch_size=1))
    return {"batches": len(out), "positions": [list(p.shape) for p in out][:1]}


def everything(stage: int) -> dict:
    """Llama with its decoder layers checkpointed, their inputs offloaded and tiled compute, under sequence
    parallelism."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return llama(stage, activation_checkpointing=LlamaDecoderLayer, offload_activations=True, tiled_compute=4)


def error_of(module: L.LightningModule, samples: list, loader=None, **strategy_kwargs) -> str:
    try:
        fit(module, samples, 2, 2, loader, **strategy_kwargs)
    except Exception as error:  # what the user sees
        return f"{type(error).__name__}: {error}"
    return "no error"


class ArangePositions(GPTLightningModule):
    """A GPT that builds its positions with ``torch.arange(T)`` (nanoGPT's way), not the helper."""

    def forward(self, idx):
        model = self.model
        x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
        for block in model.blocks:
            x = block(x)
        return model.lm_head(model.ln_f(x))


class OwnForward(GPTLightningModule):
    """The demo GPT's forward written out, its global positions from the helper, each block run by :meth:`block`."""

    def forward(self, idx):
        model = self.model
        x = model.wte(idx) + model.wpe(positions(idx.shape[1], device=idx.device))
        for block in model.blocks:
            x = self.block(block, x)
        return model.lm_head(model.ln_f(x))


class NoAttention(OwnForward):
    """Its blocks' attention left out: under sequence parallelism nothing would reach across the group."""

    def block(self, block, x):
        return x + block.mlp(block.ln_2(x))


class ReentrantCheckpoint(OwnForward):
    """Checkpoints its blocks itself with torch's reentrant checkpoint."""

    def block(self, block, x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)


class CountsItsOwnTokens(CausalLM):
    """Passes ``num_items_in_batch`` counted on the part of the batch it holds."""

    def training_step(self, batch, batch_idx):
        return self.model(**batch, num_items_in_batch=(batch["labels"] != -100).sum()).loss


def errors() -> dict:
    gpt_settings = dict(vocab_size=GPT_VOCAB, block_size=GPT_SEQUENCE, n_layer=1, n_head=2, n_embd=8)
    # a DistributedSampler made by the user without `trainer.distributed_sampler_kwargs`: one sample per rank
    own_sampler = torch.utils.data.DataLoader(
        hf_samples(), batch_size=2, sampler=torch.utils.data.DistributedSampler(hf_samples(), shuffle=False)
    )
    padded = [dict(s, attention_mask=torch.ones(hf_models.LENGTH, dtype=torch.long)) for s in hf_samples()]
    padded[1]["attention_mask"][-2:] = 0
    packed = [dict(s, position_ids=torch.arange(hf_models.LENGTH) % 6) for s in hf_samples()]
    return {
        "arange_positions": error_of(
            ArangePositions(vocab_size=GPT_VOCAB, block_size=GPT_SEQUENCE, n_layer=1, n_head=2, n_embd=8), gpt_samples()
        ),
        "padding": error_of(CausalLM(), padded),
        "packed": error_of(CausalLM(), packed),
        "odd_length": error_of(CausalLM(), hf_samples(11)),
        "odd_heads": error_of(CausalLM(hidden_size=24, num_attention_heads=3, num_key_value_heads=3), hf_samples()),
        "sliding_window": error_of(CausalLM("mixtral", sliding_window=4), hf_samples()),
        "no_attention": error_of(NoAttention(**gpt_settings), gpt_samples()),
        "reentrant_checkpoint": error_of(ReentrantCheckpoint(**gpt_settings), gpt_samples()),
        "own_sampler": error_of(CausalLM(), [], loader=own_sampler),
        "own_token_count": error_of(CountsItsOwnTokens(), hf_samples()),
    }


CASES = {
    "two_ranks": lambda: {
        **{f"gpt_stage{s}": gpt(s) for s in (1, 2, 3)},
        **{f"llama_stage{s}": llama(s) for s in (1, 2, 3)},
        "llama_everything_stage3": everything(3),
        "gpt_checkpointed_offloaded_stage3": gpt(3, activation_checkpointing=Block, offload_activations=True),
        "llama_validated_stage2": validated(2),
        # the batch holds the user's shifted labels too (DeepSpeed-Ulysses' convention): the model is handed them
        "llama_shift_labels_stage2": llama(2, shifted=True),
        "gpt2_stage2": llama(2, "gpt2"),
        # Hugging Face's own gradient checkpointing (reentrant): its attention reaches the group through the interface
        "llama_own_checkpointing_stage2": llama(2, reentrant=True),
        "rank_zero_forward_stage2": rank_zero_forward(2),
        "gpt_group_mean_stage2": group_meaned(2),
    },
    "four_ranks": lambda: {
        **{f"gpt_stage{s}": gpt(s) for s in (1, 2, 3)},
        **{f"llama_stage{s}": llama(s) for s in (1, 3)},
        # a group of 4 over 2 key/value heads: each is replicated for the 2 ranks whose query heads read it
        "llama_replicated_kv_stage2": llama(2, sequence_parallel_size=4),
        "predicted_stage2": predicted(2),
        # DeepSpeed's batch sizes count the data-parallel replicas: 2 a micro-batch x 2 accumulated x 2 replicas
        "gpt_deepspeed_config": gpt(
            None,
            config={
                "zero_optimization": {"stage": 2},
                "sequence_parallel_size": 2,
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 2,
            },
        ),
    },
    "errors": errors,
}


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
