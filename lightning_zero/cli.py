"""``lightning-zero``: train with LightningCLI, or estimate model-state memory per device.

    lightning-zero fit --config conf/gpt_zero3.yaml --trainer.max_steps 100
    lightning-zero estimate --params 7e9 --devices 8
    lightning-zero consolidate CHECKPOINT_DIR model.pt
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

GIB = 2**30


def model_state_bytes(params: float, devices: int, stage: int) -> float:
    """Bytes of parameters, gradients and Adam state per device (fp32 or mixed precision: 16 bytes per
    parameter in all, as in the ZeRO paper); stage 0 is plain data parallelism."""
    p, n = params, devices
    return {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}[stage]


def estimate(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-zero estimate", description=estimate.__doc__)
    parser.add_argument("--params", type=float, required=True, help="number of trainable parameters, e.g. 7e9")
    parser.add_argument("--devices", type=int, default=1, help="devices per node")
    parser.add_argument("--nodes", type=int, default=1)
    args = parser.parse_args(argv)
    if args.params <= 0 or args.devices < 1 or args.nodes < 1:
        parser.error("--params must be > 0, --devices and --nodes >= 1")
    world = args.devices * args.nodes
    print(f"model states per device for {args.params:.3g} parameters on {world} devices (fp32 AdamW)")
    print(f"{'strategy':<12}{'per device':>14}")
    for stage, name in ((0, "ddp"), (1, "zero1"), (2, "zero2"), (3, "zero3")):
        print(f"{name:<12}{model_state_bytes(args.params, world, stage) / GIB:>10.2f} GiB")
    return 0


def consolidate_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-zero consolidate",
        description="Turn a sharded checkpoint directory into one plain state_dict file (torch.load(..., weights_only=True)).",
    )
    parser.add_argument("src", help="sharded checkpoint directory")
    parser.add_argument("dst", help="output file")
    parser.add_argument("--optimizer", action="store_true", help="also write the optimizer states (torch.optim format)")
    args = parser.parse_args(argv)
    from lightning_zero.consolidate import consolidate

    out = consolidate(args.src, args.dst, include_optimizer=args.optimizer)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


def fit_like(argv: Sequence[str]) -> int:
    """LightningCLI over any LightningModule / LightningDataModule, with our strategies registered."""
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    import lightning_zero  # noqa: F401  (registers zero1/zero2/zero3 names)

    LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=list(argv),
        save_config_kwargs={"overwrite": True},
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "estimate":
        return estimate(argv[1:])
    if argv and argv[0] == "consolidate":
        return consolidate_command(argv[1:])
    if argv and argv[0] in ("fit", "validate", "test", "predict"):
        return fit_like(argv)
    print(__doc__.strip())
    print("\ncommands: fit, validate, test, predict, estimate, consolidate")
    return 0 if argv in ([], ["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
