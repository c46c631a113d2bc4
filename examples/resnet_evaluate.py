"""Evaluate a ZeRO-trained ResNet on one process, from its consolidated weights.

    lightning-zero fit --config conf/resnet_zero2.yaml                   # 2 ranks, ZeRO-2, sharded checkpoint
    python examples/resnet_evaluate.py runs/resnet/checkpoints/last.ckpt  # 1 process, plain PyTorch Lightning

The sharded checkpoint directory is consolidated into one ordinary ``state_dict`` file (what
``lightning-zero consolidate`` does), loaded into a freshly built model with ``load_state_dict`` and tested
with a plain single-device Trainer: no ZeroStrategy, no process group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Make `import lightning_zero` work from a plain checkout (no `pip install -e .` needed).
_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_zero.checkpoint.consolidate import consolidate  # noqa: E402
from lightning_zero.cli.command_line import CommandLine  # noqa: E402
from lightning_zero.cli.compose import compose  # noqa: E402
from lightning_zero.cli.schema import LightningSchema, import_class  # noqa: E402


def build(node: dict):
    return import_class(node["class_path"], "config")(**node.get("init_args", {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="the sharded checkpoint directory the training run wrote")
    parser.add_argument("--config", default=str(_REPO_ROOT / "conf" / "resnet_zero2.yaml"), help="the training config")
    parser.add_argument("overrides", nargs="*", help="the overrides the training run used (e.g. trainer.max_steps=40)")
    args = parser.parse_args()

    weights = consolidate(args.checkpoint, args.checkpoint.with_suffix(".pt"))
    print(f"consolidated {args.checkpoint} -> {weights} ({weights.stat().st_size / 2**20:.2f} MiB)")
    config = compose(CommandLine.parse(["test", "--config", args.config, *args.overrides]), LightningSchema("test"))
    model, data = build(config["model"]), build(config["data"])
    model.load_state_dict(torch.load(weights, weights_only=True))  # strict: every name must match

    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    result = trainer.test(model, datamodule=data, verbose=False)[0]
    print(f"single-process test: test_acc {result['test_acc']:.4f}, test_loss {result['test_loss']:.4f}")


if __name__ == "__main__":
    main()
