"""Rank program for ``test_pretrained.py``: ``ZeroStrategy(init_weights=...)`` from files written by
``save_pretrained`` / ``torch.save``, a fine-tune, and the export back to Hugging Face.

Run by ``tests/launch.py`` with a shared directory; rank 0 reports.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.consolidate import export_hf, iter_model_tensors
from lightning_zero.checkpoint.hf_export import sixteen_bit_dir
from lightning_zero.demo.data import RandomTokenDataset
from lightning_zero.engine.shard import local_rows
from tests.distributed import models
from tests.distributed.hf_models import LENGTH, MASK_ID, HFLightningModule, model_class, tiny_config
from tests.distributed.worker_core import RANK, trainer
from tests.distributed.worker_hf_models import BuiltInConfigureModel
from tests.launch import run_cases_with_directory


def data() -> RandomTokenDataset:
    return RandomTokenDataset(num_samples=16, block_size=LENGTH, vocab_size=MASK_ID, seed=3)


def pretrained_model(kind: str = "gpt2"):
    """The 'pretrained' GPT-2 (or ``kind``; seed 99), the same in the test process and on every rank."""
    torch.manual_seed(99)
    model = model_class(kind)(tiny_config(kind))
    if kind == "clip":  # a temperature unlike the config's: the value a meta build can only get from the files
        with torch.no_grad():
            model.logit_scale.fill_(1.5)
    return model


def save_pretrained_files(directory: Path) -> None:
    """Called by the test before the launch: the model saved three ways."""
    model = pretrained_model()
    model.save_pretrained(directory / "single")
    model.save_pretrained(directory / "sharded", max_shard_size="20KB")
    torch.save({f"transformer.{k}": v for k, v in model.transformer.state_dict().items()}, directory / "plain.pt")
    # The Hub's layout of a mixture of experts (one tensor per expert), which transformers 5 fuses on loading.
    pretrained_model("mixtral").save_pretrained(directory / "mixtral")
    pretrained_model("clip").save_pretrained(directory / "clip")


def pretrained(directory: Path, kind: str = "gpt2") -> dict[str, torch.Tensor]:
    return pretrained_model(kind).state_dict()


class LoadedShards(L.Callback):
    """Before any step: each rank's own rows of every parameter against the file's rows."""

    def __init__(self, expected: dict[str, torch.Tensor]) -> None:
        self.expected, self.out = expected, {}

    def on_train_start(self, trainer, pl_module):
        # The engine's rows: stage 3's DTensor shards, or at stages 1-2 the fp32 master rows (the resident
        # parameters are whole, and 2-byte copies under bf16-mixed).
        engine = trainer.strategy.engine
        records = {record.name: record for record in engine.records()}
        diff, checked = 0.0, 0
        for name, _ in pl_module.model.named_parameters():
            if name not in self.expected:
                continue
            local, want = records[f"model.{name}"].rows, local_rows(self.expected[name], engine.rank, engine.world_size)
            diff = max(diff, (local.float() - want.float()).abs().max().item() if want.numel() else 0.0)
            checked += 1
        head = getattr(pl_module.model, "lm_head", None)
        tied = head is not None and head.weight is pl_module.model.get_input_embeddings().weight
        self.out = {"diff": diff, "checked": checked, "tied": tied}


def load(directory: Path, stage: int, source: str, precision: str = "32-true", kind: str = "gpt2", **options) -> dict:
    expected = pretrained(directory, kind)
    L.seed_everything(5)
    probe = LoadedShards(expected)
    strategy = ZeroStrategy(stage=stage, init_weights=str(directory / source), **options)
    t = trainer(strategy, max_steps=3, callbacks=[probe], precision=precision)
    t.fit(BuiltInConfigureModel(kind), models.loader(data(), 2))
    return {**probe.out, "steps": t.global_step}


def errors(directory: Path) -> dict:
    pretrained(directory)
    out = {}
    for name, options in {"strict": {}, "prefix": {"init_weights_prefix": "model.transformer."}}.items():
        L.seed_everything(5)
        module = BuiltInConfigureModel("gpt2")
        module.kind = "llama"  # another architecture: nothing matches
        try:
            trainer(ZeroStrategy(stage=3, init_weights=str(directory / "single"), **options), max_steps=1).fit(
                module, models.loader(data(), 2)
            )
            out[name] = None
        except Exception as err:  # noqa: BLE001 - asserted on in the test
            out[name] = f"{type(err).__name__}: {err}"
    # Not strict: a model with a third layer loads the two layers the file has.
    L.seed_everything(5)
    config = tiny_config("gpt2")
    config.n_layer = 3
    module = BuiltInConfigureModel("gpt2")
    module.configure_model = lambda: (
        setattr(module, "model", model_class("gpt2")(config)) if module.model is None else None
    )
    t = trainer(ZeroStrategy(stage=3, init_weights=str(directory / "single"), init_weights_strict=False), max_steps=1)
    t.fit(module, models.loader(data(), 2))
    out["lenient_steps"] = t.global_step
    return out


def finetune_and_export(directory: Path) -> dict:
    """3 steps from the pretrained weights at stage 3, a sharded checkpoint with its 16-bit HF copy, then
    the export that `from_pretrained` reads, compared with the trained module on one batch."""
    pretrained(directory)
    L.seed_everything(5)
    strategy = ZeroStrategy(stage=3, init_weights=str(directory / "single"), gather_16bit_weights_on_save=True)
    t = trainer(strategy, max_steps=3, precision="bf16-mixed")
    module = BuiltInConfigureModel("gpt2")
    t.fit(module, models.loader(data(), 2))
    ckpt = directory / "finetuned"
    t.save_checkpoint(ckpt)
    state = t.strategy.full_state_dict()
    out = {}
    if RANK == 0:
        export_hf(ckpt, directory / "exported")
        # the same through the command line, in bf16
        from lightning_zero.cli import consolidate_command

        command_code = consolidate_command([str(ckpt), str(directory / "exported_bf16"), "--hf", "--dtype", "bf16"])
        trained = HFLightningModule("gpt2")
        trained.load_state_dict(state)
        batch = torch.stack([data()[i][0] for i in range(4)])
        reference = trained.model(input_ids=batch).logits
        cls = model_class("gpt2")
        exported = cls.from_pretrained(directory / "exported")
        half = cls.from_pretrained(sixteen_bit_dir(ckpt))
        out = {
            "logits_diff": (exported(input_ids=batch).logits - reference).abs().max().item(),
            "half_dtype": str(next(half.parameters()).dtype),
            "half_logits_diff": (half.float()(input_ids=batch).logits - reference).abs().max().item(),
            "exported_tied": exported.lm_head.weight is exported.transformer.wte.weight,
            "command_code": command_code,
            "command_dtype": str(next(cls.from_pretrained(directory / "exported_bf16").parameters()).dtype),
            "files": sorted(p.name for p in (directory / "exported").iterdir()),
        }
    # A new run at stage 2 (another optimizer, 2 ranks holding other rows) from the fine-tuned sharded directory.
    finetuned = {name.removeprefix("model."): tensor for name, tensor in iter_model_tensors(ckpt)}
    probe = LoadedShards(finetuned)
    L.seed_everything(5)
    again = trainer(ZeroStrategy(stage=2, init_weights=str(ckpt)), max_steps=1, callbacks=[probe])
    again.fit(BuiltInConfigureModel("gpt2"), models.loader(data(), 2))
    out["init_from_sharded_checkpoint"] = probe.out
    return out


CASES = {
    "load": lambda d: {
        **{f"stage{s}": load(d, s, "single") for s in (1, 2, 3)},
        "stage3_sharded_dir": load(d, 3, "sharded"),
        "stage2_plain_file": load(d, 2, "plain.pt"),
        "stage3_bf16": load(d, 3, "single", precision="bf16-mixed"),
        "stage2_bf16_offload": load(d, 2, "sharded", precision="bf16-mixed", offload_optimizer=True),
        **{f"mixtral_stage{s}": load(d, s, "mixtral", kind="mixtral") for s in (2, 3)},
        "clip_stage3": load(d, 3, "clip", kind="clip"),
    },
    "errors": errors,
    "export": finetune_and_export,
}

if __name__ == "__main__":
    run_cases_with_directory(CASES, sys.argv[1:])
