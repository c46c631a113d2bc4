"""Multi-node through Lightning's launchers: two `torchrun` node agents on this machine form one 2-node run;
Lightning reads torchrun's environment, and ZeroStrategy shards over both nodes (flat), or inside each node
and replicates across them (hybrid sharding, ``strategy=zero2_hsdp``: `make test-all`; hybrid sharding over
simulated nodes is in `make test` through tests/distributed/test_hybrid.py)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.cli.estimate import count_model_parameters
from lightning_zero.planning.formulas import CHOICES_BY_NAME, MIB, model_state_split
from tests.integration import background
from tests.launch import REPO, free_port

pytestmark = pytest.mark.slow
PARAMS = count_model_parameters(REPO / "conf" / "model" / "gpt_tiny.yaml")


def two_torchrun_nodes(tmp_path: Path, per_node: int, *overrides: str) -> list[dict[str, str]]:
    """``lightning-zero fit`` of the tiny GPT for 5 steps under 2 torchrun agents of ``per_node`` ranks each;
    the ZeroMonitor's rows (one per step)."""
    port = str(free_port())
    command = [
        "-m",
        "lightning_zero",
        "fit",
        "--config",
        "conf/gpt_zero3.yaml",
        "model=gpt_tiny",
        "trainer.max_steps=5",
        "+trainer.limit_val_batches=1",
        f"trainer.default_root_dir={tmp_path}",
        "trainer.num_nodes=2",
        f"trainer.devices={per_node}",
        "trainer.log_every_n_steps=1",
        *overrides,
    ]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                str(per_node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                *command,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    world = 2 * per_node
    for rank in range(world):
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world}" in outputs[rank // per_node]
    rows = [
        r
        for r in csv.DictReader(next(tmp_path.glob("logs/version_*/metrics.csv")).read_text().splitlines())
        if r.get("monitor/state_MiB_rank0")
    ]
    assert len(rows) == 5
    return rows


background.register("two_torchrun_nodes", lambda root: two_torchrun_nodes(root, 1))


def test_two_torchrun_nodes_train_one_zero3_run(runs):
    rows = runs.get("two_torchrun_nodes").result()
    # ZeRO-3 sharded over both nodes: each rank holds 16P/2 bytes of model state, and every collective crosses
    # nodes: 3P elements of fp32 per step.
    expected = sum(model_state_split(CHOICES_BY_NAME["zero3"], PARAMS, 2)) / MIB
    for rank in (0, 1):
        assert float(rows[-1][f"monitor/state_MiB_rank{rank}"]) == pytest.approx(expected, rel=0.05)
    assert float(rows[-1]["monitor/comm_inter_node_MiB"]) == pytest.approx(float(rows[-1]["monitor/comm_MiB_per_step"]))
    assert float(rows[-1]["monitor/comm_inter_node_MiB"]) == pytest.approx(4 * 3 * PARAMS / MIB, rel=0.05)


@background.in_background
def test_two_torchrun_nodes_of_two_ranks_shard_inside_each_node(tmp_path):
    """``strategy=zero2_hsdp`` (``shard_size="node"``) on 2 nodes x 2 ranks: state on the ZeRO-2 formula with
    N -> k = 2, and only the gradient shards' all-reduce (2P/k) crosses nodes, out of 2P + 2P/k in all."""
    rows = two_torchrun_nodes(tmp_path, 2, "strategy=zero2_hsdp")
    expected = sum(model_state_split(CHOICES_BY_NAME["zero2_hsdp"], PARAMS, 4, devices_per_node=2)) / MIB
    assert expected == pytest.approx((4 * PARAMS + 12 * PARAMS / 2) / MIB)
    for rank in range(4):
        assert float(rows[-1][f"monitor/state_MiB_rank{rank}"]) == pytest.approx(expected, rel=0.05)
    inter, total = float(rows[-1]["monitor/comm_inter_node_MiB"]), float(rows[-1]["monitor/comm_MiB_per_step"])
    assert inter == pytest.approx(4 * 2 * PARAMS / 2 / MIB, rel=0.05)
    assert total == pytest.approx(4 * (2 * PARAMS + 2 * PARAMS / 2) / MIB, rel=0.05)
