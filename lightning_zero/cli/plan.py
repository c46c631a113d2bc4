"""``lightning-zero plan``: the predicted peak per device and per host of every stage x offload x activation
checkpointing choice for this model and batch (activations included), and the fastest that fits the memory per
device.

    lightning-zero plan --params 6e9 --devices 32 --batch-size 64 --output ds_config.json
    lightning-zero plan --config conf/gpt_zero3.yaml --memory-per-device 16GiB --output conf/strategy/planned.yaml
    lightning-zero plan --config conf/resnet_zero2.yaml --memory-per-device 64MiB --plot plan.png

``--devices`` counts every rank, as in ``lightning-zero estimate``; ``--devices-per-node`` says how they are grouped
on nodes (whose host memory holds the offloaded state). Without ``--memory-per-device`` the plan is for this
machine's accelerator, or for a common 80 GiB device where there is none; the output says which. With ``--config``
the model is built under FakeTensorMode (nothing allocated) and one training step of a real batch of the config's
data is traced. With ``--params`` (no model code yet) the plan is for a GPT of that size (within 2%, as deep as GPT-3's shapes are
at that size; the first line gives its shape and parameter count), and
``--output`` writes a DeepSpeed-style JSON (``.json``, which ``ZeroStrategy(config=...)`` reads) or a config group
(``.yaml``). The pick is a row of the table and a bar of the plot, marked as such. The planner itself is
:mod:`lightning_zero.planning`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from lightning_zero.cli.helptext import description_and_epilog
from lightning_zero.config.memory_size import parse_bytes
from lightning_zero.planning.formulas import PRECISIONS, format_bytes, unit_for


def build_parser() -> argparse.ArgumentParser:
    description, epilog = description_and_epilog(__doc__)
    parser = argparse.ArgumentParser(
        prog="lightning-zero plan",
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", type=Path, help="a lightning-zero fit config (model, data, trainer)")
    what.add_argument("--params", type=float, help="parameters of a standard decoder-only transformer, e.g. 6e9")
    parser.add_argument(
        "--devices",
        type=int,
        help="ranks in all, over every node (default with --config: the config's trainer.devices x trainer.num_nodes)",
    )
    parser.add_argument(
        "--devices-per-node",
        type=int,
        help="ranks on one node, sharing its host memory (default: "
        "the config's trainer.devices; with --params, --devices up to 8, else 8)",
    )
    parser.add_argument("--batch-size", type=int, help="--params: sequences per optimizer step over all devices")
    parser.add_argument("--seq-len", type=int, default=2048, help="--params: tokens per sequence (default 2048)")
    parser.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=PRECISIONS,
        help="--params: the training precision (default bf16-mixed)",
    )
    parser.add_argument(
        "--memory-per-device",
        type=parse_bytes,
        help="e.g. 16GiB: pick the fastest choice that fits (default: this machine's accelerator, else 80GiB)",
    )
    parser.add_argument("--memory-per-host", type=parse_bytes, help="e.g. 64GiB: host RAM of a node, for offloading")
    parser.add_argument(
        "--optimizer-state-dtype",
        choices=("fp32", "bf16"),
        help="the optimizer's state as ZeroStrategy(optimizer_state_dtype=...) holds it (default: the config's, or fp32)",
    )
    parser.add_argument(
        "--sequence-parallel-size",
        type=int,
        help="ranks that share each sequence, as ZeroStrategy(sequence_parallel_size=...) (default: the config's, or 1)",
    )
    parser.add_argument("--plot", type=Path, help="write stacked bars by kind (PNG)")
    parser.add_argument(
        "--output", type=Path, help="write the pick: a config group YAML, or (--params) .json (DeepSpeed-style) / .yaml"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from lightning_zero.planning import NothingFits, Planner, describe, sources
    from lightning_zero.planning.output import write_generated, write_group_file
    from lightning_zero.planning.plan import PICK, activations_label, format_rows, with_pick

    if args.sequence_parallel_size is not None and args.sequence_parallel_size < 1:
        parser.error(f"--sequence-parallel-size must be 1 or more, got {args.sequence_parallel_size}")
    try:
        if args.config is not None:
            from lightning_zero.cli.command_line import CommandLine
            from lightning_zero.cli.compose import compose
            from lightning_zero.cli.schema import LightningSchema

            config = compose(CommandLine.parse(["fit", "--config", str(args.config)]), LightningSchema("fit"))
            source = sources.from_config(
                config, args.devices, name=str(args.config), devices_per_node=args.devices_per_node
            )
            if args.sequence_parallel_size is not None:
                source = dataclasses.replace(source, sequence_parallel_size=args.sequence_parallel_size)
            if source.world_size % source.sequence_parallel_size:
                raise ValueError(
                    f"sequence_parallel_size {source.sequence_parallel_size} must divide the {source.world_size} "
                    "ranks planned (each sequence is shared by that many ranks)."
                )
        else:
            if not args.devices or not args.batch_size:
                parser.error("--params needs --devices and --batch-size")
            source = sources.from_size(
                args.params,
                args.devices,
                args.batch_size,
                args.seq_len,
                args.precision,
                devices_per_node=args.devices_per_node,
                sequence_parallel_size=args.sequence_parallel_size or 1,
            )
    except (OSError, ValueError) as err:
        parser.error(str(err))
    memory, memory_source = args.memory_per_device, "--memory-per-device"
    if memory is None:
        memory, memory_source = sources.device_memory()
        memory_source += "; give --memory-per-device to plan for another"
    planner = Planner(
        source.build,
        source.batch,
        world_size=source.world_size,
        precision=source.precision,
        accumulate=source.accumulate,
        checkpointing=source.checkpointing,
        devices_per_host=source.devices_per_host,
        backend=source.backend,
        optimizer_state_dtype=args.optimizer_state_dtype or source.optimizer_state_dtype,
        clipped=source.clipped,
        tiled_compute=source.tiled_compute,
        sequence_parallel_size=source.sequence_parallel_size,
    )
    nodes = source.world_size // source.devices_per_host
    print(
        f"Plan for {source.description}; {source.world_size} rank(s) ({nodes} node(s) x {source.devices_per_host} "
        f"device(s)), {source.precision}"
        + (", bf16 optimizer states" if planner.optimizer_state_dtype == "bf16" else "")
        + f", {planner.per_device * source.accumulate} samples per device per optimizer step"
        + (
            f" (each shared by {source.sequence_parallel_size} ranks: sequence parallelism)"
            if source.sequence_parallel_size > 1
            else ""
        )
        + ":"
    )
    print(f"Memory per device: {format_bytes(memory)} ({memory_source}).")
    try:
        plan = planner.plan(memory, args.memory_per_host)
    except NothingFits as err:
        rows = describe(planner.table(), source.devices_per_host)
        print(format_rows(rows, memory, args.memory_per_host, _unit(rows)))
        print(f"lightning-zero plan: {err}")
        return 1
    except ValueError as err:  # a setting the traced step refuses (e.g. heads a sequence-parallel group cannot split)
        parser.error(str(err))
    candidates, picked = with_pick(plan)
    rows = describe(candidates, source.devices_per_host, picked)
    print(format_rows(rows, memory, args.memory_per_host, _unit(rows)))
    print(
        f"(peak per device: model state, activations, gradients and buffers of a traced step; per host: what a "
        f"node holds offloaded; micro-batch: samples per micro-batch x micro-batches accumulated; {PICK}: the "
        "fastest that fits)"
    )
    if args.plot:
        from lightning_zero.planning.plot import plot_plan

        try:
            plot_plan(rows, args.plot, title=source.description[:90], limit=memory)
        except RuntimeError as err:
            parser.error(str(err))
        print(f"wrote {args.plot}")
    pick = plan.pick
    if pick is None:
        raise RuntimeError("lightning_zero internal error: planned with a memory budget")
    host_bytes = pick.prediction.host_bytes * source.devices_per_host
    unit = unit_for(memory, pick.prediction.device_bytes, host_bytes)
    summary = (
        f"Fastest that fits {format_bytes(memory, unit)} per device: {pick.configuration.name}"
        f"{' with' + activations_label(pick)[1:] if pick.checkpointing else ''}, micro-batch {pick.micro_batch} x "
        f"{pick.accumulate} accumulated, predicted peak {format_bytes(pick.prediction.device_bytes, unit)} per "
        f"device, {format_bytes(host_bytes, unit)} per host."
    )
    print(summary)
    if args.output:
        try:
            if args.config is not None:
                write_group_file(args.output, pick, source.checkpointing, summary, source.data_keys)
            else:
                write_generated(args.output, pick, source.checkpointing, source.world_size, source.precision, summary)
        except ValueError as err:
            parser.error(str(err))
        print(
            f"wrote {args.output}"
            + (f" (use it with `strategy={args.output.stem}` from conf/strategy/)" if args.config is not None else "")
        )
    return 0


def _unit(rows: list[dict]) -> tuple[str, float]:
    """One unit for the whole table (each sentence picks one for its own numbers)."""
    return unit_for(*(r["device_bytes"] for r in rows), *(r["host_bytes"] for r in rows))
