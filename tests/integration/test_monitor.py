"""ZeroMonitor in real 2-rank runs: what it logs through Lightning's CSV logger agrees with the ZeRO formulas
(`lightning-zero estimate`) and with what the benchmark measures for the same run (`make test-all`; `make test` reads
the monitor's figures of the main job's run in test_main_job.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from lightning_zero.cli.estimate import count_model_parameters
from lightning_zero.planning.formulas import CHOICES_BY_NAME, MIB, model_state_split
from tests.integration import background
from tests.launch import REPO

pytestmark = [pytest.mark.slow, pytest.mark.full]


@background.in_background
def test_logged_state_bytes_match_the_estimate_and_the_progress_bar_shows_the_monitor(tmp_path):
    callbacks = (
        "++trainer.callbacks=[{class_path: lightning_zero.observability.ZeroMonitor, init_args: {log_every_n_steps: 2}}, "
        f"{{class_path: tests.integration.cli_support.RecordRun, init_args: {{path: {tmp_path}/run.pt}}}}]"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_zero",
            "fit",
            "--config",
            "conf/gpt_zero3.yaml",
            "model=gpt_tiny",
            "strategy=zero2",
            "trainer.max_steps=4",
            "+trainer.limit_val_batches=1",
            f"trainer.default_root_dir={tmp_path}",
            "trainer.enable_progress_bar=false",
            callbacks,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = list(csv.DictReader(next(tmp_path.glob("logs/version_*/metrics.csv")).read_text().splitlines()))
    logged = [r for r in rows if r.get("monitor/state_MiB_rank0")]
    assert [int(r["step"]) for r in logged] == [1, 3]  # optimizer steps 2 and 4 (Lightning logs step - 1)
    params = count_model_parameters(REPO / "conf" / "model" / "gpt_tiny.yaml")
    expected = sum(model_state_split(CHOICES_BY_NAME["zero2"], params, 2)) / MIB
    for row in logged:
        for rank in (0, 1):
            state = float(row[f"monitor/state_MiB_rank{rank}"])
            assert state == pytest.approx(expected, rel=0.05)
            assert float(row[f"monitor/peak_MiB_rank{rank}"]) > 100 * state  # the whole process's peak RSS
        # 2 ranks x 16 sequences x 32 tokens per step, a few steps per second on this machine
        assert 100 < float(row["monitor/tokens_per_s"]) < 1e6
        # stage 2, fp32: a reduce-scatter of the gradients and an all-gather of the parameters, 2 x 4P bytes
        assert float(row["monitor/comm_MiB_per_step"]) == pytest.approx(8 * params / MIB, rel=0.05)
    info = torch.load(tmp_path / "run.pt", weights_only=True)["info"]
    assert {"tok/s", "state_MiB", "comm_MiB"} <= set(info["progress_bar"])


@background.in_background
def test_monitor_figures_equal_the_benchmark_measurements_of_the_same_run():
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_core.py",
            "--quick",
            "--systems",
            "zero2,zero3+offload",
            "--monitor",
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["system"] for r in runs] == ["zero2", "zero3+offload"], result.stderr[-4000:]  # bench_core's failure log
    for run in runs:
        monitor = run["monitor"]
        # the benchmark counts every live tensor (a GC walk); the monitor asks the engine: same bytes
        assert monitor["monitor/state_MiB_max"] * MIB == pytest.approx(run["state_bytes"], rel=0.01), run["system"]
        assert monitor["monitor/comm_MiB_per_step"] * MIB == pytest.approx(run["comm_bytes_per_step"], rel=0.01)
        if run["system"].endswith("offload"):  # the split by placement, against the formulas
            assert monitor["monitor/device_MiB_rank0"] * MIB == pytest.approx(run["formula_device_bytes"], rel=0.01)
            assert monitor["monitor/host_MiB_rank0"] * MIB == pytest.approx(run["formula_host_bytes"], rel=0.01)
