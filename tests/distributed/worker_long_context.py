"""Rank program for the long-sequence tests: activation offload and tiled compute inside ``lightning.Trainer``.

Run by ``tests/launch.py`` (``python -m tests.distributed.worker_long_context GROUP``); rank 0 reports.
"""

from __future__ import annotations

import sys

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.demo import GPTLightningModule
from lightning_zero.demo.gpt import Block
from lightning_zero.engine.comm import collectives
from tests.distributed import hf_models
from tests.distributed.worker_core import RANK, max_diff, run_scale, trainer
from tests.launch import run_cases

SEQUENCE = 32
WIDTH = 16
LAYERS = 3
BATCH = 4


def gpt_data() -> torch.utils.data.DataLoader:
    tokens = [torch.randint(0, 32, (SEQUENCE + 1,), generator=torch.Generator().manual_seed(i)) for i in range(48)]
    return torch.utils.data.DataLoader([(t[:-1], t[1:]) for t in tokens], batch_size=BATCH)


def gpt_run(stage: int, precision: str = "32-true", **strategy_kwargs) -> tuple[L.Trainer, dict]:
    """3 steps of 2 accumulated micro-batches of a dropout GPT, clipped, its blocks checkpointed."""
    L.seed_everything(3)
    module = GPTLightningModule(vocab_size=32, block_size=SEQUENCE, n_layer=LAYERS, n_head=2, n_embd=WIDTH, dropout=0.1)
    # the bytes of an element of a block's input, as the run computes it (4 in fp32; bf16-mixed's may be 2)
    module.model.blocks[0].register_forward_pre_hook(
        lambda block, args: setattr(module, "input_bytes", args[0].element_size())
    )
    strategy = ZeroStrategy(stage=stage, activation_checkpointing=Block, state_dict_type="full", **strategy_kwargs)
    t = trainer(
        strategy,
        max_steps=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        limit_val_batches=0,
        precision=precision,
    )
    t.fit(module, gpt_data())
    t.input_bytes = module.input_bytes
    return t, t.strategy.full_state_dict()


def offload(stage: int, precision: str = "32-true", **strategy_kwargs) -> dict:
    """The GPT with its checkpointed blocks' inputs offloaded, against checkpointing alone."""
    _, checkpointed = gpt_run(stage, precision, **strategy_kwargs)
    t, offloaded = gpt_run(stage, precision, offload_activations=True, **strategy_kwargs)
    statistics = t.strategy.activation_offload.statistics
    out = {
        "trained": t.global_step,
        **run_scale(t),
        "statistics": collectives.all_gather_objects(vars(statistics)),
        # each micro-batch, every block's input (B, T, C) in fp32
        "expected_offloaded": 6 * LAYERS * BATCH * SEQUENCE * WIDTH * t.input_bytes,
        "expected_prefetched": 6 * (LAYERS - 1) * BATCH * SEQUENCE * WIDTH * t.input_bytes,
        "input_bytes": t.input_bytes,
    }
    if RANK == 0:
        out["param_diff"] = max_diff(checkpointed, offloaded)
    return out


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM trained the way its users write it: the model computes the loss from ``labels``."""

    def __init__(self, kind: str, **config) -> None:
        super().__init__()
        settings = hf_models.tiny_config(kind)
        for key, value in config.items():  # e.g. a larger vocabulary or more positions
            setattr(settings, key, value)
        self.model = hf_models.model_class(kind)(settings)
        self.logits_seen: list[bool] = []

    def training_step(self, batch, batch_idx):
        output = self.model(input_ids=batch[0], labels=batch[0])
        self.logits_seen.append(output.logits is not None)
        self.log("train_loss", output.loss)
        return output.loss

    def configure_optimizers(self):
        # SGD: AdamW would step a gradient that cancels to its own rounding (an embedding row of a rare token) at
        # full size in either summation order, and the tiles sum in another order (tests/tolerances.py)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def hf_data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf_models.VOCAB, (24, hf_models.LENGTH), generator=g)
    tokens[::3, :3] = -100  # some positions that do not count (a prompt's, masked by the user)
    return torch.utils.data.DataLoader([(t.clamp(min=0), t) for t in tokens], batch_size=3)


class LabelsAsGiven(CausalLM):
    """Labels with ignored positions (the batch's second entry), as a fine-tuning script masks its prompt."""

    def training_step(self, batch, batch_idx):
        output = self.model(input_ids=batch[0], labels=batch[1])
        self.logits_seen.append(output.logits is not None)
        return output.loss


def hf_run(kind: str, stage: int, **strategy_kwargs) -> tuple[L.Trainer, dict, LabelsAsGiven]:
    """2 steps of 2 accumulated micro-batches, clipped, of a tiny HF causal LM on 2 ranks."""
    L.seed_everything(5)
    module = LabelsAsGiven(kind)
    strategy = ZeroStrategy(stage=stage, state_dict_type="full", **strategy_kwargs)
    t = trainer(strategy, max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5, limit_val_batches=0)
    t.fit(module, hf_data())
    return t, t.strategy.full_state_dict(), module


def tiled(kind: str, stage: int, **extra) -> dict:
    """The model with its MLPs and its head with the loss in tiles of 5 positions (of 12), against it untiled."""
    _, whole, _ = hf_run(kind, stage, **extra)
    t, tiles, module = hf_run(kind, stage, tiled_compute=5, **extra)
    out = {
        "trained": t.global_step,
        **run_scale(t),
        "logits_seen": module.logits_seen,
        "left_wrapped": [n for n, m in module.model.named_modules() if "forward" in m.__dict__],
    }
    if RANK == 0:
        out["param_diff"] = max_diff(whole, tiles)
    return out


def everything(stage: int) -> dict:
    """Llama with its decoder layers checkpointed, their inputs offloaded, and tiled compute, against plain."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    _, plain, _ = hf_run("llama", stage)
    t, composed, _ = hf_run(
        "llama", stage, activation_checkpointing=LlamaDecoderLayer, offload_activations=True, tiled_compute=5
    )
    out = {**run_scale(t), "offloaded_bytes": t.strategy.activation_offload.statistics.offloaded_bytes}
    if RANK == 0:
        out["param_diff"] = max_diff(plain, composed)
    return out


CASES = {
    "tiled": lambda: {
        **{f"llama_stage{s}": tiled("llama", s) for s in (1, 2, 3)},
        "gpt2_stage3": tiled("gpt2", 3),
        "mixtral_stage2": tiled("mixtral", 2),
        "everything_stage3": everything(3),
    },
    "offload": lambda: {
        **{f"stage{s}": offload(s) for s in (1, 2, 3)},
        # bf16 autocast replayed in the recomputation, the parameters and the optimizer on the host too
        "stage3_bf16_offloaded_params": offload(3, "bf16-mixed", offload_params=True),
    },
}


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
