"""`lightning-zero estimate`: the ZeRO formulas, the recommendation, the YAML it writes and the plot."""

from __future__ import annotations

import json
import re
import struct
import zlib

import pytest
import yaml

from lightning_zero.cli.estimate import count_model_parameters
from lightning_zero.cli.estimate import main as estimate_main
from lightning_zero.config.memory_size import parse_bytes
from lightning_zero.demo import GPTConfig, count_parameters
from lightning_zero.planning.formulas import (
    CHOICES,
    CHOICES_BY_NAME,
    GIB,
    estimate,
    fastest_fitting,
    model_state_split,
)
from tests.launch import REPO

BY_NAME = CHOICES_BY_NAME


@pytest.mark.parametrize(
    "params, world, choice, precision, device, host",
    [
        # the ZeRO paper's Figure 1 example: 7.5B parameters, 64 GPUs, mixed precision (K = 12)
        (7.5e9, 64, "ddp", "bf16-mixed", 120e9, 0),
        (7.5e9, 64, "zero1", "bf16-mixed", 2 * 7.5e9 + 2 * 7.5e9 + 12 * 7.5e9 / 64, 0),  # 31.4 GB
        (7.5e9, 64, "zero2", "16-mixed", 2 * 7.5e9 + 14 * 7.5e9 / 64, 0),  # 16.6 GB
        (7.5e9, 64, "zero3", "bf16-mixed", 16 * 7.5e9 / 64, 0),  # 1.9 GB
        # fp32 Adam: 4 + 4 + 8 bytes
        (1e9, 8, "zero1", "32-true", 8e9 + 8e9 / 8, 0),
        (1e9, 8, "zero2", "32-true", 4e9 + 12e9 / 8, 0),
        (1e9, 8, "zero3", "32-true", 16e9 / 8, 0),
        # offload: fp32 masters, their gradients and Adam's moments on the host, 16P/N
        (1e9, 8, "zero1_offload", "32-true", 8e9, 2e9),
        (1e9, 8, "zero2_offload", "bf16-mixed", 2e9 + 2e9 / 8, 2e9),
        (1e9, 8, "zero3_offload_optimizer", "32-true", 8e9 / 8, 2e9),
        (1e9, 8, "zero3_offload", "bf16-mixed", 0, 2e9),
        # the delayed update: a second fp32 gradient shard on the host, 20P/N
        (1e9, 8, "zero2_offload_delay", "bf16-mixed", 2e9 + 2e9 / 8, 2.5e9),
        # selective updates: 10% of the columns' masters and moments on the device, two interval sums on the host, 24P/N
        (1e9, 8, "zero2_offload_selective", "bf16-mixed", 2e9 + 2e9 / 8 + 0.1 * 12e9 / 8, 3e9),
    ],
)
def test_formulas(params, world, choice, precision, device, host):
    assert model_state_split(BY_NAME[choice], params, world, precision) == pytest.approx((device, host))


def test_host_memory_is_per_node_and_nodes_multiply_the_ranks():
    rows = {e.choice.name: e for e in estimate(1.3e9, devices=8, nodes=2, precision="bf16-mixed")}
    assert rows["zero3"].device_bytes == pytest.approx(16 * 1.3e9 / 16)
    assert rows["zero2_offload"].host_bytes_per_node == pytest.approx(
        8 * 16 * 1.3e9 / 16
    )  # 8 devices share a node's RAM


def test_the_delayed_update_has_a_row_and_is_never_the_pick():
    """Inexact by design, so never recommended: it needs the device memory of the exact offload before it, and more
    host memory, so whatever it fits, the exact step fits first."""
    rows = estimate(1.3e9, devices=8, precision="bf16-mixed")
    names = [e.choice.name for e in rows]
    assert names.index("zero2_offload_delay") == names.index("zero2_offload") + 1
    delayed = rows[names.index("zero2_offload_delay")]
    assert (delayed.choice.offload, delayed.choice.strategy()["init_args"]) == (
        "optimizer, delayed",
        {"stage": 2, "offload_optimizer": True, "offload_step_delay": 1},
    )
    picks = {fastest_fitting(rows, quarters * GIB / 4).choice.name for quarters in range(1, 100)}
    assert "zero2_offload" in picks and "zero2_offload_delay" not in picks
    selective = rows[names.index("zero2_offload_selective")]
    assert selective.choice.offload == "optimizer, selective k=4"
    assert "zero2_offload_selective" not in picks  # more device memory than the exact offload before it


def test_the_fastest_fitting_choice_and_memory_sizes():
    rows = estimate(7e9, devices=8)
    assert fastest_fitting(rows, parse_bytes("80GiB")).choice.name == "zero1"  # ddp needs 112 GB
    assert fastest_fitting(rows, parse_bytes("16GiB")).choice.name == "zero3"
    assert fastest_fitting(rows, parse_bytes("8GiB")).choice.name == "zero3_offload_optimizer"
    assert (
        fastest_fitting(rows, parse_bytes("8GiB"), host_bytes_per_node=parse_bytes("64GiB")) is None
    )  # 112 GB offloaded
    assert parse_bytes("80GB") == 80e9 and parse_bytes("24000MiB") == 24000 * 2**20 and parse_bytes("2 GiB") == 2 * GIB
    for bad in ("80 parsecs", "80", "1.2.3GiB"):
        with pytest.raises(ValueError, match="write a number and a unit"):
            parse_bytes(bad)


def test_parameters_of_a_model_yaml_are_counted_on_the_meta_device():
    expected = count_parameters(GPTConfig(vocab_size=34, block_size=64, n_layer=4, n_head=4, n_embd=128))
    assert count_model_parameters(REPO / "conf" / "model" / "gpt_small.yaml") == expected
    assert count_model_parameters(REPO / "conf" / "gpt_zero3.yaml") == expected  # a whole config, composed


def _png_text(path) -> dict[str, str]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, offset = {}, 8
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset : offset + 4]), data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        assert struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])[0] == zlib.crc32(kind + body)
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode()] = value.decode("latin-1")
        offset += 12 + length
    assert kind == b"IEND"
    return chunks


def table_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("ddp", "zero"))}


def test_command_prints_the_table_writes_the_recommendation_and_plots_one_bar_group_per_stage(tmp_path, capsys):
    plot, output = tmp_path / "memory.png", tmp_path / "strategy" / "recommended.yaml"
    assert (
        estimate_main(
            [
                "--params",
                "1.3e9",
                "--devices",
                "16",
                "--devices-per-node",
                "8",
                "--precision",
                "bf16-mixed",
                "--memory-per-device",
                "3GiB",
                "--plot",
                str(plot),
                "--output",
                str(output),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "on 16 rank(s) (2 node(s) x 8 device(s)), bf16-mixed" in out
    rows = table_rows(out)
    assert list(rows) == [c.name for c in CHOICES]
    assert float(rows["zero2"][3]) == pytest.approx((2 * 1.3e9 + 14 * 1.3e9 / 16) / GIB, abs=0.01)
    assert float(rows["zero2_offload"][4]) == pytest.approx(8 * 16 * 1.3e9 / 16 / GIB, abs=0.01)
    assert "zero2_offload, 2.57 GiB per device, 9.69 GiB per host" in out  # zero2 needs 3.48 GiB
    # the pick is marked in the table, and only there
    assert [name for name, row in rows.items() if row[-2:] == ["<-", "pick"]] == ["zero2_offload"]
    written = yaml.safe_load(output.read_text())
    assert written == {
        "class_path": "lightning_zero.ZeroStrategy",
        "init_args": {"stage": 2, "offload_optimizer": True},
    }
    assert output.read_text().startswith("# @package trainer.strategy\n")

    shown = json.loads(_png_text(plot)["Description"])
    assert shown["groups"] == ["DDP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert len(shown["bars"]) == len(CHOICES)
    assert [b["choice"] for b in shown["bars"] if b["pick"]] == ["zero2_offload"]
    assert shown["legend_px"][0] >= shown["axes_px"][2]  # beside the axes: it covers no bar
    # and in the pixels: just above the x axis, the coloured columns form one cluster per stage
    from matplotlib.image import imread

    image = imread(plot)
    x0, _, x1, bottom = shown["axes_px"]
    row = image[bottom - 3, x0 + 2 : x1 - 2, :3]
    inked = [bool((pixel < 0.9).any()) for pixel in row]
    unit = (x1 - x0) / len(shown["groups"])
    clusters, last = 0, None
    for x, ink in enumerate(inked):
        if ink:
            if last is None or x - last > 0.17 * unit:
                clusters += 1
            last = x
    assert clusters == 4
    # nothing in the legend's box is drawn by the axes: it stands right of them
    lx0, ly0, lx1, ly1 = shown["legend_px"]
    assert lx0 > x1 and 0 <= ly0 < ly1 <= image.shape[0]


def test_nothing_fits_is_exit_status_1(capsys):
    assert (
        estimate_main(
            ["--params", "7e9", "--devices", "1", "--memory-per-device", "1GiB", "--memory-per-host", "64GiB"]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "nothing fits in 1.00 GiB per device and 64.00 GiB per host" in out
    fits = [row[-1] for row in table_rows(out).values()]
    assert fits == ["no"] * len(
        [c for c in CHOICES if not c.across_nodes]
    )  # zero3_offload needs no device memory but 104 GiB of host


def test_devices_counts_every_rank_as_in_plan(capsys):
    """`--devices` is the ranks in all for `estimate` and `plan` alike; nodes are `--devices-per-node`, 8 by default
    (issue 36, item 9). The old `--nodes` is refused with the spelling that means the same."""
    assert estimate_main(["--params", "1e9", "--devices", "16"]) == 0
    out = capsys.readouterr().out
    assert "on 16 rank(s) (2 node(s) x 8 device(s))" in out
    assert float(table_rows(out)["zero3"][3]) == pytest.approx(16 * 1e9 / 16 / GIB, abs=0.01)  # sharded over 16
    assert estimate_main(["--params", "1e9", "--devices", "4"]) == 0
    assert "on 4 rank(s) (1 node(s) x 4 device(s))" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        estimate_main(["--params", "1e9", "--devices", "8", "--nodes", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "lightning-zero estimate: error: --nodes is gone: --devices now counts every rank, as in `lightning-zero "
        "plan`; for 2 node(s) of 8 devices write --devices 16 --devices-per-node 8"
    )
    with pytest.raises(SystemExit):
        estimate_main(["--params", "1e9", "--devices", "16", "--devices-per-node", "5"])
    assert "--devices-per-node 5 must be >= 1 and divide --devices 16" in capsys.readouterr().err
    # plan's --devices: the same ranks in all, on the same nodes
    from lightning_zero.planning.sources import from_size

    source = from_size(1e9, devices=16, batch_size=32)
    assert (source.world_size, source.devices_per_host) == (16, 8)
    source = from_size(1e9, devices=16, batch_size=32, devices_per_node=4)
    assert (source.world_size, source.devices_per_host) == (16, 4)


UNIT = re.compile(r"(?<![A-Za-z])(B|KB|MB|GB|KiB|MiB|GiB|TiB)\b")


@pytest.mark.parametrize("params, unit", [(7e9, "GiB"), (1e6, "MiB")])
def test_one_binary_unit_in_the_whole_output(capsys, params, unit):
    assert estimate_main(["--params", str(params), "--devices", "8", "--memory-per-device", "80GiB"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith(("strategy", "ddp", "zero"))]
    assert {found for line in table for found in UNIT.findall(line)} == {unit}
    for line in out.splitlines():
        assert set(UNIT.findall(line)) <= {"GiB", "MiB"} and len(set(UNIT.findall(line))) <= 1, line


def test_help_has_no_rest_markup():
    from lightning_zero.cli.estimate import build_parser

    text = build_parser().format_help()
    assert "`" not in text and ":class:" not in text and ":func:" not in text
    assert "--devices counts every rank, as in lightning-zero plan" in text


@pytest.mark.parametrize(
    "choice, precision, device, host",
    [
        # Adam's moments in bf16: 4 bytes instead of 8, so 12 bytes a parameter where fp32 states take 16
        ("ddp", "bf16-mixed", 16e9, 0),  # Lightning's ddp holds the optimizer's own state
        ("zero1", "bf16-mixed", 4e9 + 8e9 / 8, 0),
        ("zero2", "32-true", 4e9 + 8e9 / 8, 0),
        ("zero3", "bf16-mixed", 12e9 / 8, 0),
        ("zero2_offload", "bf16-mixed", 2e9 + 2e9 / 8, 12e9 / 8),
        ("zero3_offload", "bf16-mixed", 0, 12e9 / 8),
        ("zero2_offload_delay", "bf16-mixed", 2e9 + 2e9 / 8, 16e9 / 8),
        ("zero2_offload_selective", "bf16-mixed", 2e9 + 2e9 / 8 + 0.1 * 8e9 / 8, 20e9 / 8),
    ],
)
def test_formulas_with_bf16_optimizer_states(choice, precision, device, host):
    split = model_state_split(BY_NAME[choice], 1e9, 8, precision, optimizer_state_dtype="bf16")
    assert split == pytest.approx((device, host))


def test_the_command_counts_bf16_optimizer_states(capsys):
    assert estimate_main(["--params", "1e9", "--devices", "8", "--optimizer-state-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "Adam with bf16 moments" in out
    zero3 = next(line for line in out.splitlines() if line.startswith("zero3 "))
    assert f"{12e9 / 8 / GIB:.2f}" in zero3
