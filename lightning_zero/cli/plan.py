"""``lightning-zero plan``: the predicted peak per device and per host of every stage x offload x activation
checkpointing choice for this model and batch (activations included), and the fastest that fits a budget.

    lightning-zero plan --config conf/gpt_zero3.yaml --memory-per-device 16GiB --output conf/strategy/planned.yaml
    lightning-zero plan --config conf/resnet_zero2.yaml --memory-per-device 64MiB --plot plan.png
    lightning-zero plan --params 6e9 --devices 32 --batch-size 64 --seq-len 2048 --memory-per-device 80GiB --output ds_config.json

With ``--config`` the model is built under FakeTensorMode (nothing allocated) and one training step of a real
batch of the config's data is traced. With ``--params`` (no model code yet) the plan is for a GPT of GPT-3's shape
closest in size. The planner itself is ``lightning_zero.planning``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lightning_zero.planning.formulas import parse_bytes


def format_rows(rows: list[dict], budget: float | None, host_budget: float | None) -> str:
    scale, unit = (2**30, "GiB") if max(r["device_bytes"] for r in rows) >= 2**30 else (2**20, "MiB")
    lines = [f"{'configuration':<28}{'checkpointing':>14}{'micro-batch':>12}{'device_' + unit:>14}{'host_' + unit:>12}"
             + (f"{'fits':>6}" if budget is not None else "")]
    for r in rows:
        line = (f"{r['configuration']:<28}{'yes' if r['checkpointing'] else 'no':>14}{r['micro_batch']:>12}"
                f"{r['device_bytes'] / scale:>14.2f}{r['host_bytes'] / scale:>12.2f}")
        if budget is not None:
            fits = r["device_bytes"] <= budget and (host_budget is None or r["host_bytes"] <= host_budget)
            line += f"{'yes' if fits else 'no':>6}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-zero plan", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", type=Path, help="a `lightning-zero fit` config (model, data, trainer)")
    what.add_argument("--params", type=float, help="parameters of a standard decoder-only transformer, e.g. 6e9")
    parser.add_argument("--devices", type=int, help="ranks in all (default: the config's trainer.devices x num_nodes)")
    parser.add_argument("--batch-size", type=int, help="--params: sequences per optimizer step over all devices")
    parser.add_argument("--seq-len", type=int, default=2048, help="--params: tokens per sequence (default 2048)")
    parser.add_argument("--precision", default="bf16-mixed", help="--params: 32-true, bf16-mixed or 16-mixed")
    parser.add_argument("--memory-per-device", type=parse_bytes, help="e.g. 16GiB: pick the fastest choice that fits")
    parser.add_argument("--memory-per-host", type=parse_bytes, help="e.g. 64GiB: host RAM of a node, for offloading")
    parser.add_argument("--plot", type=Path, help="write stacked bars by kind (PNG)")
    parser.add_argument("--output", type=Path, help="write the pick: a config group YAML, or (--params) .json / .yaml")
    args = parser.parse_args(argv)
    if args.output is not None and args.memory_per_device is None:
        parser.error("--output writes the fastest choice that fits: give --memory-per-device too")
    from lightning_zero.planning import NothingFits, Planner, describe, sources
    from lightning_zero.planning.plan import format_bytes
    from lightning_zero.planning.output import write_generated, write_group_file

    try:
        if args.config is not None:
            from lightning_zero.cli.command_line import CommandLine
            from lightning_zero.cli.compose import compose
            from lightning_zero.cli.schema import LightningSchema

            config = compose(CommandLine.parse(["fit", "--config", str(args.config)]), LightningSchema("fit"))
            source = sources.from_config(config, args.devices, name=str(args.config))
        else:
            if not args.devices or not args.batch_size:
                parser.error("--params needs --devices and --batch-size")
            source = sources.from_size(args.params, args.devices, args.batch_size, args.seq_len, args.precision)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    planner = Planner(source.build, source.batch, world_size=source.world_size, precision=source.precision,
                      accumulate=source.accumulate, checkpointing=source.checkpointing,
                      devices_per_host=source.devices_per_host, backend=source.backend)
    print(f"Plan for {source.description}; {source.world_size} rank(s), {source.precision}, "
          f"{planner.per_device} samples per device per micro-batch x {source.accumulate} accumulated:")
    try:
        plan = planner.plan(args.memory_per_device, args.memory_per_host)
    except NothingFits as err:
        print(format_rows(describe(planner.table(), source.devices_per_host), args.memory_per_device, args.memory_per_host))
        print(f"lightning-zero plan: {err}")
        return 1
    rows = describe(plan.table, source.devices_per_host)
    print(format_rows(rows, args.memory_per_device, args.memory_per_host))
    print("(peak per device: model state, activations, gradients and buffers of a traced step; per host: what a "
          "node holds offloaded)")
    if args.plot:
        from lightning_zero.planning.plot import plot_plan

        try:
            plot_plan(rows, args.plot, title=source.description[:90], limit=args.memory_per_device)
        except RuntimeError as err:
            parser.error(str(err))
        print(f"wrote {args.plot}")
    if plan.pick is None:
        return 0
    pick = plan.pick
    summary = (f"Fastest that fits {format_bytes(args.memory_per_device)} per device: {pick.configuration.name}"
               f"{' with activation checkpointing' if pick.checkpointing else ''}, micro-batch {pick.micro_batch} x "
               f"{pick.accumulate} accumulated, predicted peak {format_bytes(pick.prediction.device_bytes)} per device, "
               f"{format_bytes(pick.prediction.host_bytes * source.devices_per_host)} per host.")
    print(summary)
    if args.output:
        try:
            if args.config is not None:
                write_group_file(args.output, pick, source.checkpointing, summary, source.data_keys)
            else:
                write_generated(args.output, pick, source.checkpointing, source.world_size, source.precision, summary)
        except ValueError as err:
            parser.error(str(err))
        print(f"wrote {args.output}" + (f" (use it with `strategy={args.output.stem}` from conf/strategy/)"
                                        if args.config is not None else ""))
    return 0
