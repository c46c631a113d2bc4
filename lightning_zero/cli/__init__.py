"""``lightning-zero``: train with LightningCLI over composed YAML, estimate and plan memory, consolidate and verify
checkpoints.

    lightning-zero fit --config conf/gpt_zero3.yaml trainer.max_steps=100 strategy=zero2 model.n_layer=2
    lightning-zero fit --config conf/gpt_zero3.yaml --print_config > run.yaml
    lightning-zero validate --config run.yaml ckpt_path=runs/last.ckpt
    lightning-zero estimate --params 7e9 --devices 8 --memory-per-device 80GiB --plot memory.png
    lightning-zero plan --config conf/gpt_zero3.yaml --memory-per-device 16GiB --output conf/strategy/planned.yaml
    lightning-zero plan --params 6e9 --devices 32 --batch-size 64 --output ds_config.json
    lightning-zero consolidate CHECKPOINT_DIR model.pt
    lightning-zero verify CHECKPOINT_DIR_OR_FILE   # whole, damaged or left by an interrupted save (exit 0/1)

Overrides after the config are Hydra's: `a.b=c` sets, `+a.b=c` adds, `++a.b=c` adds or sets, `~a.b`
deletes, `group=option` picks conf/<group>/<option>.yaml; `strategy.X` is short for
`trainer.strategy.init_args.X` and `model.X` for `model.init_args.X`. LightningCLI's own
`--trainer.max_steps 100` keeps working.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_zero.cli.command_line import SUBCOMMANDS
from lightning_zero.cli.errors import CLIConfigError, argument_error_line, one_line
from lightning_zero.cli.helptext import plain
from lightning_zero.config.choices import closest

#: Every ``lightning-zero`` command: LightningCLI's subcommands, then our tools.
COMMANDS = (*SUBCOMMANDS, "estimate", "plan", "consolidate", "verify")


def consolidate_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-zero consolidate",
        description="Turn a sharded checkpoint directory into one plain state_dict file (torch.load(..., weights_only=True)).",
    )
    parser.add_argument("src", help="sharded checkpoint directory")
    parser.add_argument("dst", help="output file")
    parser.add_argument("--optimizer", action="store_true", help="also write the optimizer states (torch.optim format)")
    parser.add_argument(
        "--hf",
        action="store_true",
        help="write a Hugging Face directory (config.json + safetensors) "
        "that from_pretrained reads, instead of one file",
    )
    parser.add_argument(
        "--hf-config",
        help="--hf: a directory with the model's config.json, for checkpoints that do not "
        "describe their Hugging Face model",
    )
    parser.add_argument("--prefix", help="--hf: the prefix of the model's names in the LightningModule (e.g. 'model.')")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="--hf: dtype of the written weights")
    parser.add_argument("--max-shard-size", default="5GB", help="--hf: largest safetensors file (default 5GB)")
    args = parser.parse_args(argv)
    from lightning_zero.checkpoint.consolidate import consolidate, export_hf
    from lightning_zero.checkpoint.verify import CheckpointError

    try:
        if args.hf:
            out = export_hf(
                args.src,
                args.dst,
                dtype=args.dtype,
                hf_config=args.hf_config,
                prefix=args.prefix,
                max_shard_size=args.max_shard_size,
            )
        else:
            out = consolidate(args.src, args.dst, include_optimizer=args.optimizer)
    except (CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"lightning-zero consolidate: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir()) if out.is_dir() else out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    if command == "estimate":
        from lightning_zero.cli.estimate import main as estimate

        return estimate(argv[1:])
    if command == "plan":
        from lightning_zero.cli.plan import main as plan

        return plan(argv[1:])
    if command == "consolidate":
        return consolidate_command(argv[1:])
    if command == "verify":
        from lightning_zero.cli.verify import main as verify

        return verify(argv[1:])
    if command in SUBCOMMANDS:
        return train_command(argv)
    if argv in ([], ["-h"], ["--help"]):
        print(plain(__doc__).strip())
        print(f"\ncommands: {', '.join(COMMANDS)}")
        return 0
    print(
        f"lightning-zero: error: unknown command {command!r}; the commands are {', '.join(COMMANDS)}."
        f"{closest(command, COMMANDS)}",
        file=sys.stderr,
    )
    return 2


def train_command(argv: Sequence[str]) -> int:
    """``fit``/``validate``/``test``/``predict``: a user's mistake ends in one line and exit status 2.

    Most are found before any rank starts (see ``train.py``), so the line is printed once; a checkpoint damaged in
    a way only the load finds (a CRC-32) fails in every launched rank, and each prints the line once."""
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_zero.checkpoint.verify import CheckpointError
    from lightning_zero.cli.train import run
    from lightning_zero.config.choices import ZeroConfigError

    try:
        run(argv)
    except ArgumentError as err:  # a value of the wrong type: jsonargparse's report, made one line
        message = argument_error_line(str(err))
    except (CLIConfigError, ZeroConfigError, CheckpointError, MisconfigurationException) as err:
        message = one_line(str(err))
    else:
        return 0
    print(f"lightning-zero {argv[0]}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
