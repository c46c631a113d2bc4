"""Multi-node through Lightning's launchers: two `torchrun` node agents on this machine (1 rank each) form one
2-node run; Lightning reads torchrun's environment, and ZeroStrategy shards over both nodes."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from lightning_zero.cli.estimate import count_model_parameters
from lightning_zero.estimate import CHOICES_BY_NAME, MIB, model_state_split
from tests.launch import REPO, free_port

pytestmark = pytest.mark.slow


def test_two_torchrun_nodes_train_one_zero3_run(tmp_path):
    port = str(free_port())
    command = [
        "-m", "lightning_zero", "fit", "--config", "conf/gpt_zero3.yaml", "model=gpt_tiny", "trainer.max_steps=5",
        "+trainer.limit_val_batches=1", f"trainer.default_root_dir={tmp_path}", "trainer.num_nodes=2", "trainer.devices=1",
        "trainer.log_every_n_steps=1",
    ]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, *command],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in outputs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
    # ZeRO-3 sharded over both nodes: each rank holds 16P/2 bytes of model state
    params = count_model_parameters(REPO / "conf" / "model" / "gpt_tiny.yaml")
    expected = sum(model_state_split(CHOICES_BY_NAME["zero3"], params, 2)) / MIB
    rows = [r for r in csv.DictReader(open(next(tmp_path.glob("logs/version_*/metrics.csv")))) if r.get("monitor/state_MiB_rank1")]
    assert len(rows) == 5
    for rank in (0, 1):
        assert float(rows[-1][f"monitor/state_MiB_rank{rank}"]) == pytest.approx(expected, rel=0.05)
