"""The planner in one process: tracing allocates nothing, the private torch API it stands on, the refusal, the
command line (a config's plan written as a group file and drawn; a size's plan as DeepSpeed JSON read back)."""

import json
import resource

import pytest
import torch
import yaml

from lightning_zero import ZeroStrategy
from lightning_zero.cli.plan import main as plan_main
from lightning_zero.demo.gpt import Block, GPTLightningModule
from lightning_zero.planning import Configuration, NothingFits, Planner, predict, trace_step
from lightning_zero.planning.measure import _TotalsOnly

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


def test_nothing_fits_says_the_smallest_peak_and_what_would_fit():
    planner = Planner(lambda: GPTLightningModule(**TINY), _batch(), world_size=2, checkpointing=Block)
    with pytest.raises(NothingFits) as err:
        planner.plan(64 * 1024)
    text = str(err.value)
    assert "Nothing fits in 0.06 MiB per device" in text and "smallest predicted peak" in text
    assert "micro-batch 1" in text and "More devices" in text


def test_plan_writes_a_group_file_and_a_plot(tmp_path, capsys):
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
    from PIL import Image

    shown = json.loads(Image.open(png).text["Description"])
    assert len(shown["bars"]) == 14 and all(b["device_MiB"] > 0 for b in shown["bars"])
    assert "Fastest that fits" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_plan_for_a_size_writes_a_config_the_strategy_reads_back(tmp_path, suffix):
    out = tmp_path / f"generated{suffix}"
    assert plan_main(["--params", "1.3e9", "--devices", "8", "--batch-size", "32", "--seq-len", "512",
                      "--memory-per-device", "24GiB", "--output", str(out)]) == 0
    if suffix == ".json":
        config = json.loads(out.read_text())
        assert config["train_batch_size"] == 32 and config["bf16"] == {"enabled": True}
        strategy = ZeroStrategy(config=str(out))
        assert strategy.stage == config["zero_optimization"]["stage"]
    else:
        assert yaml.safe_load(out.read_text())["trainer"]["strategy"]["class_path"] == "lightning_zero.ZeroStrategy"


def test_plan_refuses_bad_requests(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--params", "1e9", "--devices", "3", "--batch-size", "8"])
    assert "multiple of --devices" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(["--config", "conf/gpt_zero3.yaml", "--output", "x.yaml"])
    assert "--memory-per-device" in capsys.readouterr().err
    assert plan_main(["--config", "conf/gpt_zero3.yaml", "--memory-per-device", "64KiB"]) == 1
    assert "Nothing fits" in capsys.readouterr().out


def test_deepspeed_offload_ratio_maps_to_a_partial_offload():
    strategy = ZeroStrategy(config={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert strategy.zero_config.offload_optimizer == 0.3
