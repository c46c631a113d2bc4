"""``lightning-zero estimate``: model-state memory per device for every ZeRO stage."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

GIB = 2**30


def model_state_bytes(params: float, devices: int, stage: int) -> float:
    """Bytes of parameters, gradients and Adam state per device (fp32 or mixed precision: 16 bytes per
    parameter in all, as in the ZeRO paper); stage 0 is plain data parallelism."""
    p, n = params, devices
    return {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}[stage]


def estimate(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-zero estimate", description=__doc__)
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
