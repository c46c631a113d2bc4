"""Ranks that make different Trainer calls under `torchrun`: rank 1's script ends after the first `fit` while rank 0
starts a second one (as a `trainer.test(...)` under `if trainer.is_global_zero:` does). torchrun stops the other
workers when one fails, not when one ends well, so rank 0 must fail by itself, at once and naming rank 1, rather
than wait out the rendezvous timeout (`lightning_zero/strategy/attempt_store.py`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration import background
from tests.launch import REPO, free_port

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import lightning as L, torch
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_zero import ZeroStrategy

    def run():
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2), max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(BoringModel())
        return trainer

    if run().global_rank == 0:
        run()
""")


def rank_1_ends_after_the_first_fit(root: Path) -> dict:
    script = root / "uneven.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {
        "returncode": result.returncode,
        "seconds": time.monotonic() - started,
        "output": result.stdout + result.stderr,
    }


background.register("rank_1_ends_after_the_first_fit", rank_1_ends_after_the_first_fit)


def test_a_rank_starting_a_run_its_peer_ended_before_fails_at_once_naming_it(runs):
    result = runs.get("rank_1_ends_after_the_first_fit").result()
    assert result["returncode"] != 0
    assert (
        "rank 0 starts another run, but rank(s) [1] ended their script after the last one and will not start it: "
        "every rank must make the same Trainer calls"
    ) in result["output"], result["output"][-3000:]
    assert result["seconds"] < 120  # the rendezvous timeout is 10 minutes
