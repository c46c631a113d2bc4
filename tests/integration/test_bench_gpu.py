"""benchmarks/bench_gpu.py: refuses clearly without CUDA, and its measurement path runs end to end (on the CPU
through its development switch) so that the script a GPU session runs has not rotted in between."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration import background

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda(capsys) -> None:
    assert bench_gpu.main([]) == 2  # the script's `sys.exit(main())`, in this process
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "bench_core.py" in err


def test_ladder_doubles_width_then_depth() -> None:
    base = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    shapes = bench_gpu.ladder(base, 4)
    assert [(s["n_layer"], s["n_embd"], s["n_head"]) for s in shapes] == [
        (2, 32, 2),
        (2, 64, 4),
        (4, 64, 4),
        (4, 128, 8),
    ]


def test_mfu_counts_attention_and_uses_the_known_peak() -> None:
    config = bench_gpu.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert bench_gpu.model_flops_per_token(config) == 6 * bench_gpu.count_parameters(config) + 12 * 2 * 32 * 16
    assert bench_gpu.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert bench_gpu.peak_tflops("Some GPU", None) is None and bench_gpu.peak_tflops("Some GPU", 100.0) == 100.0


def test_rounds_combine_into_the_median_of_each_rounds_ratio_to_ddp() -> None:
    def run(system: str, round_index: int, step_ms: float) -> dict:
        return dict(
            system=system,
            round=round_index,
            step_ms=step_ms,
            tokens_per_s=1e3 / step_ms,
            cpu_ms_per_step=step_ms,
            mfu=None,
        )

    ddp = [run("ddp", 0, 10.0), run("ddp", 1, 30.0), run("ddp", 2, 12.0)]
    zero1 = [run("zero1", 0, 13.0), run("zero1", 1, 31.0), run("zero1", 2, 12.6)]  # 1.3, 1.03, 1.05 times DDP's
    combined = bench_gpu.combine_rounds(zero1, ddp)
    assert combined["rounds_step_ms"] == [13.0, 31.0, 12.6] and combined["step_ms"] == 13.0
    assert combined["vs_ddp"] == pytest.approx(1.05)  # not 13.0 / 12.0, the medians' ratio: each round its own
    assert bench_gpu.combine_rounds(zero1, [])["vs_ddp"] is None


@background.in_background
def test_both_parts_run_end_to_end_on_the_cpu() -> None:
    proc = _run(
        "--accelerator",
        "cpu",
        "--quick",
        "--systems",
        "zero3+offload_params",
        "--search-systems",
        "zero2",
        "--rungs",
        "2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    throughput, _, largest = proc.stdout.partition("largest that trains")
    assert "zero3+offload_params" in throughput and "tokens/s" in throughput
    assert "zero2" in largest and "2 x 128" in largest  # the second rung trains


def test_the_gpu_session_script_asks_only_for_what_the_benchmarks_accept() -> None:
    """benchmarks/gpu_session.sh is what a session with a GPU lent runs first: its commands must still parse when
    that session comes (a typo there would cost a device call)."""
    listed = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_session.sh")],
        env={**os.environ, "DRY": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=True,
    ).stdout
    commands = [shlex.split(line.split("): ", 1)[1]) for line in listed.splitlines() if line.startswith("== ")]
    assert len(commands) == 14, listed
    for command in commands:
        assert Path(command[0]).name.startswith("python") and (ROOT / command[1]).is_file(), command
        if command[1].endswith("bench_gpu.py"):
            args = bench_gpu.parse_args(command[2:])
            assert set(args.systems) <= set(bench_gpu.THROUGHPUT_SYSTEMS), args.systems
            if args.model is not None:
                assert json.loads(args.model)["n_embd"] == 2048  # the 1.34B GPT of the offload targets


@background.in_background
def test_the_profile_part_shows_the_delayed_host_step_in_a_lane_of_its_own(tmp_path) -> None:
    """The offloaded step's timeline (benchmarks/timeline.py) must see the host-step thread at all: torch.profiler
    records only the thread that entered it unless asked for every thread. Under ``offload_step_delay=1`` the host
    AdamW step runs in a background thread, so its lane is not the training thread's."""
    proc = _run(
        "--accelerator",
        "cpu",
        "--quick",
        "--part",
        "profile",
        "--systems",
        "zero2+offload_delay",
        "--profile-dir",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "profile_zero2_offload_delay.txt").read_text().split("\n\n")[0].splitlines()
    assert table[0].startswith("timeline over 3 step(s)")
    lanes = {line.split("  ")[0]: line for line in table[2:]}
    training = next(iter(lanes))  # the busiest lane, first: forward and backward (its costliest events vary by run)
    assert any(op in lanes[training] for op in ("aten::linear", "aten::mm", "autograd::engine", "ScaledDotProduct"))
    host_step = [lane for lane, line in lanes.items() if "_fused_adamw_" in line or "AdamW.step" in line]
    assert host_step and training not in host_step, table
