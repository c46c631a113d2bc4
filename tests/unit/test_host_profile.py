"""The host-time profile of benchmarks/bench_overhead.py (benchmarks/host_profile.py): which package a profiled
function's self time is charged to, and a real cProfile summary."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from host_profile import HostProfile, category  # noqa: E402

import lightning_zero  # noqa: E402
import lightning_zero.engine.shard as shard  # noqa: E402

PACKAGE = Path(lightning_zero.__file__).parent


def test_functions_are_charged_to_their_package():
    site = "/usr/lib/python3.11/site-packages"
    assert category(f"{PACKAGE}/engine/stage3/fsdp2.py", "f") == "ours: lightning_zero/engine/stage3"
    assert category(f"{PACKAGE}/monitor.py", "f") == "ours: lightning_zero/monitor"
    assert category(f"{PACKAGE}/demo/gpt.py", "forward") == "model (demo GPT)"
    # A clone is often called lightning_zero too: its benchmarks are not the package.
    assert category("/home/me/lightning_zero/benchmarks/bench_core.py", "f") == "benchmark harness"
    assert (
        category(f"{site}/torch/distributed/fsdp/_fully_shard/_fsdp_state.py", "f") == "FSDP2 (torch.distributed.fsdp)"
    )
    assert category(f"{site}/torch/distributed/tensor/_dispatch.py", "f") == "torch.distributed (Python)"
    assert category(f"{site}/lightning/pytorch/loops/fit_loop.py", "run") == "Lightning"
    assert (
        category("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>") == "autograd engine (C++ backward)"
    )
    assert category("~", "<built-in method torch.addmm>") == "torch operators (C++)"
    assert category("~", "<built-in method builtins.len>") == "Python built-ins"


def test_a_profiled_window_sums_per_step_and_names_our_functions():
    profile = HostProfile()
    for _ in range(2):
        profile.enter()
        for _ in range(200):
            shard.row_range((10, 3), 1, 2)
        torch.ones(3).add_(1)
        profile.leave()
    summary = profile.summary(steps=2)
    assert summary["ms_per_step"]["ours: lightning_zero/engine"] > 0
    assert summary["total_ms_per_step"] >= sum(summary["ms_per_step"].values()) - 1e-9
    assert any(name.startswith("engine/shard.py:") and calls == 200 for name, _, calls in summary["top_ours"])
    assert any("add_" in name and calls == 1 for name, _, calls in summary["top_operators"])
