"""The planner in one process: tracing allocates nothing, the private torch API it stands on, the refusal, the
command line (a config's plan written as a group file and drawn; a size's plan as DeepSpeed JSON read back)."""

import dataclasses
import json
import re
import resource

import pytest
import torch
import yaml

from lightning_zero import ZeroStrategy
from lightning_zero.cli.plan import main as plan_main
from lightning_zero.demo.gpt import Block, GPTLightningModule
from lightning_zero.demo.vision import BasicBlock, ResNetClassifier
from lightning_zero.planning import Configuration, NothingFits, Planner, predict, trace_step
from lightning_zero.planning.measure import _TotalsOnly

UNIT = re.compile(r"(?<![A-Za-z])(B|KB|MB|GB|KiB|MiB|GiB|TiB)\b")
TINY = dict(vocab_size=34, block_size=32, n_layer=2, n_head=2, n_embd=32)


def _batch(size=4, length=32):
    tokens = torch.randint(0, 34, (size, length))
    return tokens, tokens


def test_tracing_a_billion_parameter_model_allocates_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trace = trace_step(lambda: GPTLightningModule(vocab_size=50257, block_size=256, n_layer=24, n_head=16, n_embd=2048),
                       _batch(1, 256))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert trace.params > 1.3e9 and trace.state_per_element == 2.0  # AdamW
    assert grown_kib < 1e6, "a 1.3B model's 5 GB of fp32 weights must never exist"
    assert trace.activation_peak > 0 and len(trace.unit_elements) == 24


def test_memtracker_totals_count_storages_once_and_follow_frees():
    """Pins the private ``torch.distributed._tools.mem_tracker`` API the measurement and the trace rely on."""
    held = torch.zeros(1000)
    tracker = _TotalsOnly()
    tracker.track_external(held)
    with tracker:
        a = torch.empty(2000)
        del a  # freed: the peak keeps it, the current total does not
        b = torch.empty(500)
        c = torch.empty(100)
        view = c[:10]  # a view: no storage of its own, and it keeps c's alive
        del c
    peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    now = sum(d["Total"] for d in tracker.get_tracker_snapshot("current").values())
    assert peak == 4000 + 8000 and now == 4000 + 2000 + 400
    del view, b


def test_stages_order_as_the_formulas_say_and_checkpointing_trims_activations():
    plain = trace_step(lambda: GPTLightningModule(**TINY), _batch())
    checkpointed = trace_step(lambda: GPTLightningModule(**TINY), _batch(), activation_checkpointing=Block)
    assert checkpointed.activation_peak < plain.activation_peak
    static = {s: predict(plain, Configuration(s), 2).breakdown for s in (1, 2, 3)}
    assert static[3]["parameters"] * 2 == pytest.approx(4 * plain.params, rel=1e-6)  # fp32 shards: 4P/N
    assert static[1]["optimizer state"] == pytest.approx(8 * plain.params / 2)  # AdamW: 8P/N
    offloaded = predict(plain, Configuration(2, offload_optimizer=0.5), 2)
    assert offloaded.host_bytes == pytest.approx(0.5 * (8 + 4 + 4) * plain.params / 2)  # state, masters, grads


def test_frozen_layers_under_mixed_precision_trace_a_second_step_as_stage_3_holds_them():
    """Stages 1-2 keep a frozen layer as built and autocast saves a bf16 copy of its weight for backward; stage 3
    gathers it in bf16 and saves no copy, so its timeline is traced apart and its peak is lower."""

    def frozen_gpt():
        module = GPTLightningModule(**TINY)
        module.model.blocks[0].requires_grad_(False)
        return module

    mixed = trace_step(frozen_gpt, _batch(), precision="bf16-mixed")
    assert mixed.stage3_timeline is not None and mixed.timeline_at(1) is mixed.timeline
    assert max(o for o, _ in mixed.timeline_at(3)) < max(o for o, _ in mixed.timeline)
    assert predict(mixed, Configuration(3), 2).device_bytes < predict(
        dataclasses.replace(mixed, stage3_timeline=None), Configuration(3), 2).device_bytes
    for nothing_differs in (trace_step(frozen_gpt, _batch()), trace_step(lambda: GPTLightningModule(**TINY), _batch(),
                                                                          precision="bf16-mixed")):
        assert nothing_differs.stage3_timeline is None


def test_a_constructor_that_deep_copies_a_tensor_keeps_the_traces_fake_mode():
    """torchmetrics deep-copies each state's default as the metric is built: a deep copy that took the fake mode with
    it duplicated the mode's storage weak references, released twice later (glibc: "corrupted double-linked list")."""
    built = []

    def with_a_metric():
        module = ResNetClassifier(num_classes=10, width=8, blocks_per_stage=(1,))  # BatchNorm: constants in the mode
        built.append(module)
        return module

    images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    trace = trace_step(with_a_metric, (images, labels), activation_checkpointing=BasicBlock)
    metric = built[0].val_accuracy
    assert trace.activation_peak > 0
    assert metric._defaults["tp"].fake_mode is metric.tp.fake_mode


def test_nothing_fits_says_the_smallest_peak_and_what_would_fit():
    planner = Planner(lambda: GPTLightningModule(**TINY), _batch(), world_size=2, checkpointing=Block)
    with pytest.raises(NothingFits) as err:
        planner.plan(64 * 1024)
    text = str(err.value)
    assert "Nothing fits in 0.06 MiB per device" in text and "smallest predicted peak" in text
    assert "micro-batch 1" in text and "More devices" in text


def table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("zero", "ddp"))]


def assert_one_binary_unit_per_line(out: str) -> None:
    """Sizes are GiB or MiB (binary, never MB/GB), and no line or table mixes them."""
    for line in out.splitlines():
        units = set(UNIT.findall(line))
        assert units <= {"GiB", "MiB"} and len(units) <= 1, line
    headers = [line for line in out.splitlines() if line.startswith("configuration")]
    units = {UNIT.search(line)[0] for line in headers + table_rows(out) if UNIT.search(line)}
    assert len(units) <= 1, units


def test_plan_writes_a_group_file_and_a_plot_with_the_pick_in_both(tmp_path, capsys):
    out, png = tmp_path / "planned.yaml", tmp_path / "plan.png"
    assert plan_main(["--config", "conf/gpt_zero3.yaml", "--memory-per-device", "20MiB", "--output", str(out),
                      "--plot", str(png)]) == 0
    text = out.read_text()
    assert text.startswith("# @package _global_")
    written = yaml.safe_load(text)
    strategy = written["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_zero.ZeroStrategy"
    micro, accumulate = written["data"]["init_args"]["batch_size"], written["trainer"]["accumulate_grad_batches"]
    assert micro * accumulate == 16  # conf/data/chars.yaml's batch, kept
    ZeroStrategy(**strategy["init_args"])  # valid settings
    printed = capsys.readouterr().out
    assert "Memory per device: 20.00 MiB (--memory-per-device)." in printed
    assert_one_binary_unit_per_line(printed)

    # the pick (micro-batch 4 x 4, not in the table at the full batch of 16) is a row of its own, marked
    picked = [row.split() for row in table_rows(printed) if row.endswith("<- pick")]
    assert len(picked) == 1
    name, checkpointing, micro_text, _, accumulate_text, device, host, fits = picked[0][:8]
    assert (int(micro_text), int(accumulate_text)) == (micro, accumulate) and fits == "yes"
    assert f"Fastest that fits 20.00 MiB per device: {name}" in printed
    assert f"micro-batch {micro} x {accumulate} accumulated, predicted peak {device} MiB per device" in printed

    # ... and a bar of the plot, marked; the legend stands beside the axes, covering no bar
    from PIL import Image

    shown = json.loads(Image.open(png).text["Description"])
    assert len(shown["bars"]) == 15 and all(b["device_MiB"] > 0 for b in shown["bars"])
    bars = [b for b in shown["bars"] if b["pick"]]
    assert len(bars) == 1 and bars[0]["label"].endswith(f"{micro} x {accumulate} (pick)")
    assert bars[0]["device_MiB"] == pytest.approx(float(device), abs=0.01)
    assert shown["legend_px"][0] >= shown["axes_px"][2]


@pytest.mark.parametrize("suffix", [".json", pytest.param(".yaml", marks=pytest.mark.full)])
def test_plan_for_a_size_writes_a_config_the_strategy_reads_back(tmp_path, suffix, capsys, monkeypatch):
    """.json: the plain form a config generator's user types, without --memory-per-device (issue 36, item 3)."""
    out = tmp_path / f"generated{suffix}"
    budget = [] if suffix == ".json" else ["--memory-per-device", "24GiB"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan_main(["--params", "125e6", "--devices", "8", "--batch-size", "8", "--seq-len", "512", *budget,
                      "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert_one_binary_unit_per_line(printed)
    assert "; 8 rank(s) (1 node(s) x 8 device(s)), bf16-mixed" in printed
    if suffix == ".json":
        assert ("Memory per device: 80.00 GiB (assumed: no accelerator on this machine, so a common 80 GiB device "
                "such as an A100 or H100; give --memory-per-device to plan for another).") in printed
        assert "Fastest that fits 80.00 GiB per device" in printed
        config = json.loads(out.read_text())
        assert config["train_batch_size"] == 8 and config["bf16"] == {"enabled": True}
        strategy = ZeroStrategy(config=str(out))
        assert strategy.stage == config["zero_optimization"]["stage"]
    else:
        assert "Fastest that fits 24.00 GiB per device" in printed
        assert yaml.safe_load(out.read_text())["trainer"]["strategy"]["class_path"] == "lightning_zero.ZeroStrategy"


def test_the_default_memory_is_the_local_accelerators(monkeypatch):
    from types import SimpleNamespace

    from lightning_zero.planning import sources

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=85_000_000_000, name="NVIDIA H100 80GB HBM3"))
    assert sources.device_memory() == (85e9, "this machine's NVIDIA H100 80GB HBM3 (cuda:0)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sources.device_memory()[0] == 80 * 2**30


def test_plan_refuses_bad_requests(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--params", "1e9", "--devices", "3", "--batch-size", "8"])
    assert "multiple of --devices" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(["--params", "1e9", "--devices", "12", "--batch-size", "24"])
    assert "--devices 12 is not a whole number of 8-device nodes: give --devices-per-node" in capsys.readouterr().err
    assert plan_main(["--params", "125e6", "--devices", "2", "--batch-size", "2", "--seq-len", "64",
                      "--memory-per-device", "64KiB"]) == 1
    printed = capsys.readouterr().out
    assert "Nothing fits" in printed
    assert_one_binary_unit_per_line(printed)


def test_plan_help_has_no_rest_markup():
    from lightning_zero.cli.plan import build_parser

    text = build_parser().format_help()
    assert "`" not in text and ":mod:" not in text and ":class:" not in text
    assert "--devices counts every rank, as in lightning-zero estimate" in text


def test_deepspeed_offload_ratio_maps_to_a_partial_offload():
    strategy = ZeroStrategy(config={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert strategy.zero_config.offload_optimizer == 0.3
