"""``lightning-zero estimate``: model-state memory per device and per host, for every stage and offload choice.

    lightning-zero estimate --params 1.3e9 --devices 16 --devices-per-node 8 --precision bf16-mixed
    lightning-zero estimate --model conf/model/gpt_small.yaml --devices 2 --plot memory.png
    lightning-zero estimate --params 7e9 --devices 8 --memory-per-device 80GiB --output conf/strategy/recommended.yaml

``--devices`` counts every rank, as in ``lightning-zero plan``; ``--devices-per-node`` says how they are grouped on
nodes (default: up to 8 ranks are one node, more are nodes of 8). DeepSpeed's estimator prints numbers; this one
also draws them, marks the fastest choice that fits ``--memory-per-device`` in the table and the plot, and writes it
as a config group file, ready for ``strategy=recommended``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_zero.cli.helptext import description_and_epilog
from lightning_zero.config.memory_size import parse_bytes
from lightning_zero.planning.formulas import (
    PRECISIONS,
    Estimate,
    estimate,
    fastest_fitting,
    format_bytes,
    split_devices,
    unit_for,
)

PICK = "<- pick"


def count_model_parameters(path: str | Path) -> int:
    """Trainable parameters of the model a YAML file describes, built on the meta device (nothing allocated).

    The file is a model node (``class_path`` + ``init_args``, as in conf/model/) or a whole config with a
    ``model`` key (composed with its defaults, as ``fit`` would)."""
    import torch

    from lightning_zero.cli.command_line import CommandLine
    from lightning_zero.cli.compose import compose, load_yaml, resolve
    from lightning_zero.cli.schema import LightningSchema, import_class

    data, _ = load_yaml(Path(path))
    node: Any
    if "class_path" in data:
        node = resolve(data)
    else:
        node = compose(CommandLine.parse(["fit", "--config", str(path)]), LightningSchema("fit")).get("model")
    if not isinstance(node, dict) or "class_path" not in node:
        raise ValueError(f"{path} describes no model: expected `class_path` (and `init_args`), or a `model:` key.")
    cls = import_class(node["class_path"], "model")
    with torch.device("meta"):
        module = cls(**(node.get("init_args") or {}))
        if callable(getattr(module, "configure_model", None)):
            module.configure_model()  # models built lazily, as Lightning builds them inside the strategy
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def format_table(
    estimates: Sequence[Estimate], limit: float | None = None, host_limit: float | None = None, pick: str | None = None
) -> str:
    """The table in one unit (GiB once any figure reaches 1 GiB, else MiB); ``pick`` names the row marked as the
    fastest that fits."""
    unit, scale = unit_for(*(e.device_bytes for e in estimates), *(e.host_bytes_per_node for e in estimates))
    header = f"{'strategy':<26}{'stage':>5}  {'offload':<18}{'per_device_' + unit:>18}{'per_host_' + unit:>16}"
    nodes = any(e.inter_node_elements for e in estimates)
    if nodes:
        header += f"{'inter_node_xP':>15}"
    if limit is not None:
        header += f"{'fits':>6}"
    lines = [header]
    for e in estimates:
        line = f"{e.choice.name:<26}{e.choice.stage:>5}  {e.choice.offload:<18}{e.device_bytes / scale:>18.2f}{e.host_bytes_per_node / scale:>16.2f}"
        if nodes:
            line += f"{e.inter_node_elements:>15.3g}"
        if limit is not None:
            line += f"{'yes' if e.fits(limit, host_limit) else 'no':>6}"
        if e.choice.name == pick:
            line += f"  {PICK}"
        lines.append(line)
    return "\n".join(lines)


def write_strategy(estimate_: Estimate, path: Path, summary: str) -> None:
    """A config group file for ``trainer.strategy``: ``strategy=<file stem>`` on the command line picks it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(estimate_.choice.strategy(), sort_keys=False)
    path.write_text(f"# @package trainer.strategy\n# {summary}\n{body}")


def build_parser() -> argparse.ArgumentParser:
    description, epilog = description_and_epilog(__doc__)
    parser = argparse.ArgumentParser(
        prog="lightning-zero estimate",
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="number of trainable parameters, e.g. 1.3e9")
    size.add_argument(
        "--model", help="a model YAML (conf/model/*.yaml or a full config); parameters counted on the meta device"
    )
    parser.add_argument("--devices", type=int, default=1, help="ranks in all, over every node (default 1)")
    parser.add_argument(
        "--devices-per-node",
        type=int,
        help="ranks on one node, sharing its host memory (default: --devices up to 8, else 8)",
    )
    parser.add_argument("--nodes", type=int, help=argparse.SUPPRESS)  # removed: refused with the new spelling
    parser.add_argument("--precision", default="32-true", choices=PRECISIONS)
    parser.add_argument(
        "--optimizer-state-dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="Adam's moments as ZeroStrategy(optimizer_state_dtype=...) holds them (default fp32)",
    )
    parser.add_argument("--plot", type=Path, help="write a bar chart (PNG) of the table")
    parser.add_argument("--memory-per-device", type=parse_bytes, help="e.g. 80GiB: name the fastest choice that fits")
    parser.add_argument(
        "--memory-per-host", type=parse_bytes, help="e.g. 512GiB: host RAM of a node, for offloading choices"
    )
    parser.add_argument(
        "--output", type=Path, help="write the fastest fitting choice as a strategy YAML (needs --memory-per-device)"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.nodes is not None:
        per_node = args.devices_per_node or args.devices
        parser.error(
            f"--nodes is gone: --devices now counts every rank, as in `lightning-zero plan`; for {args.nodes} "
            f"node(s) of {per_node} devices write --devices {args.nodes * per_node} --devices-per-node {per_node}"
        )
    try:
        per_node, nodes = split_devices(args.devices, args.devices_per_node)
    except ValueError as err:
        parser.error(str(err))
    if args.output and args.memory_per_device is None:
        parser.error("--output writes the fastest choice that fits: give --memory-per-device too")
    if args.model:
        try:
            params = count_model_parameters(args.model)
        except (OSError, ValueError) as err:
            parser.error(str(err))
        source = f" ({args.model})"
    else:
        params, source = args.params, ""
    if params <= 0:
        parser.error("--params must be > 0")
    estimates = estimate(params, per_node, nodes, args.precision, optimizer_state_dtype=args.optimizer_state_dtype)
    world = args.devices
    best = None
    if args.memory_per_device is not None:
        best = fastest_fitting(estimates, args.memory_per_device, args.memory_per_host)
    pick = best.choice.name if best is not None else None
    print(
        f"Model states of {params:,.0f} parameters{source} on {world} rank(s) ({nodes} node(s) x {per_node} "
        f"device(s)), {args.precision}, Adam"
        + (" with bf16 moments (stages 1-3):" if args.optimizer_state_dtype == "bf16" else ":")
    )
    print(format_table(estimates, args.memory_per_device, args.memory_per_host, pick=pick))
    print(
        "(parameters, gradients and optimizer state only: activations and temporary buffers come on top"
        + (f"; {PICK}: the fastest that fits)" if best is not None else ")")
    )
    if nodes > 1:
        print(
            "(inter_node_xP: elements each rank sends across nodes per step, in units of the parameter count; the *_hsdp\n"
            " choices shard inside a node and replicate across nodes, zero3_hpz keeps a node-local parameter copy)"
        )
    if args.plot:
        from lightning_zero.planning.formulas_plot import plot_estimates

        try:
            plot_estimates(
                estimates,
                args.plot,
                title=f"{params:.3g} parameters, {world} ranks, {args.precision}",
                limit=args.memory_per_device,
                pick=pick,
            )
        except RuntimeError as err:  # matplotlib missing
            parser.error(str(err))
        print(f"wrote {args.plot}")
    if args.memory_per_device is None:
        return 0
    if best is None:
        unit = unit_for(args.memory_per_device, args.memory_per_host or 0.0)
        host = f" and {format_bytes(args.memory_per_host, unit)} per host" if args.memory_per_host is not None else ""
        print(f"nothing fits in {format_bytes(args.memory_per_device, unit)} per device{host}: add devices or nodes.")
        return 1
    unit = unit_for(args.memory_per_device, best.device_bytes, best.host_bytes_per_node)
    summary = (
        f"fastest choice whose model states fit {format_bytes(args.memory_per_device, unit)} per device for "
        f"{params:.3g} parameters on {world} ranks ({args.precision}): {best.choice.name}, "
        f"{format_bytes(best.device_bytes, unit)} per device, "
        f"{format_bytes(best.host_bytes_per_node, unit)} per host"
    )
    print(summary[0].upper() + summary[1:])
    if args.output:
        write_strategy(best, args.output, summary)
        print(f"wrote {args.output} (use it with `strategy={args.output.stem}` when it sits in conf/strategy/)")
    return 0
