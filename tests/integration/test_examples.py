"""Every example, in a short mode, run as a user runs it; each one's loss must fall. The main job (the README's
`make run`) and its Python twin are in test_main_job.py."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import background
from tests.launch import REPO

pytestmark = pytest.mark.slow


def run(*args: str, cwd=REPO, timeout: float = 400) -> str:
    result = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout


def loss_summary(stdout: str) -> tuple[float, float]:
    """LossReport's `loss A -> B` (first step -> mean of the last steps)."""
    found = re.findall(r"^loss (\d+\.\d+) -> (\d+\.\d+)", stdout, flags=re.MULTILINE)
    assert found, stdout[-3000:]
    return tuple(map(float, found[-1]))


#: Each example's short mode: what it runs, given a folder of its own (started by ``background.py``).
EXAMPLES = {
    "quickstart": lambda root: run(sys.executable, "examples/quickstart.py"),
    "bert": lambda root: bert_first_run(root),
    "resnet": lambda root: resnet_runs(root),
    # 2 stages x 1 replica: stages x replicas on 4 ranks is tests/distributed/test_pipeline_trainer.py's
    "pipeline": lambda root: run(
        sys.executable, "examples/gpt_pipeline.py", "--devices", "2", "--max-steps", "30", "--out", str(root)
    ),
    "hf_finetune": lambda root: run(
        sys.executable, "examples/hf_finetune.py", "--out", str(root), "--pretrain-steps", "30", "--max-steps", "20"
    ),
    "fabric_litgpt": lambda root: fabric_litgpt_runs(root),
}
for _name, _run in EXAMPLES.items():
    background.register(f"example_{_name}", _run)


@pytest.fixture(scope="module")
def examples(runs) -> dict[str, background.Started]:
    return {name: runs.get(f"example_{name}") for name in EXAMPLES}


def fabric_litgpt_runs(root: Path) -> tuple[str, str]:
    """30 steps (a checkpoint at step 20), then a second run to step 40 that resumes from it."""
    command = [sys.executable, "examples/fabric_litgpt.py", "--out", str(root), "--save-every", "20"]
    return run(*command, "--max-steps", "30"), run(*command, "--max-steps", "40")


def test_litgpt_in_a_fabric_loop_with_zero3_learns_and_resumes(examples):
    pytest.importorskip("litgpt", reason="LitGPT is installed by `make install` (pip install --no-deps litgpt)")
    first_run, resumed_run = examples["fabric_litgpt"].result()
    first, last = loss_summary(first_run)
    assert last < first - 1.0, (first, last)
    assert "resumed from step 20" in resumed_run
    assert "(20 steps, zero3)" in resumed_run


def test_quickstart(examples):
    first, last = loss_summary(examples["quickstart"].result())
    assert last < first - 0.3, (first, last)


BERT_ARGS = [
    "-m",
    "lightning_zero",
    "fit",
    "--config",
    "conf/bert_mlm_zero1.yaml",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.callbacks.0.every_n_train_steps=3",
    "trainer.log_every_n_steps=1",
]


def bert_first_run(root) -> str:
    out = run(sys.executable, *BERT_ARGS, f"trainer.default_root_dir={root}", "trainer.max_steps=6")
    checkpoints = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert checkpoints == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    rows = list(csv.DictReader(sorted(root.glob("logs/version_*/metrics.csv"))[-1].read_text().splitlines()))
    assert any(float(r.get("monitor/loss_scale") or 0) >= 2**15 for r in rows)  # fp16 with loss scaling, not bf16
    return out


def test_bert_masked_lm_with_zero1_offload_fp16_checkpoints(examples):
    first, last = loss_summary(examples["bert"].result())
    assert last < first, (first, last)


@background.in_background
def test_bert_masked_lm_with_zero1_offload_fp16_checkpoints_and_resumes(tmp_path):
    first_run = bert_first_run(tmp_path)
    resumed = run(
        sys.executable,
        *BERT_ARGS,
        f"trainer.default_root_dir={tmp_path}",
        "trainer.max_steps=10",
        f"+ckpt_path={tmp_path}/checkpoints/last.ckpt",
    )
    # the model's own state came back with the weights: 6 steps x 16 samples x 2 ranks
    assert re.search(r"resumed at step 6: 192 samples seen, best val_loss \d+\.\d+", resumed), resumed[-2000:]
    rows = list(csv.DictReader(sorted(tmp_path.glob("logs/version_*/metrics.csv"))[-1].read_text().splitlines()))
    assert max(float(r["samples_seen"]) for r in rows if r.get("samples_seen")) == 10 * 16 * 2
    first, _ = loss_summary(first_run)
    _, last = loss_summary(resumed)
    assert last < first - 0.3, (first, last)


def resnet_runs(root: Path) -> tuple[str, str]:
    overrides = ["trainer.max_steps=40", f"trainer.default_root_dir={root}"]
    trained = run(sys.executable, "-m", "lightning_zero", "fit", "--config", "conf/resnet_zero2.yaml", *overrides)
    evaluated = run(sys.executable, "examples/resnet_evaluate.py", str(root / "checkpoints" / "last.ckpt"), *overrides)
    return trained, evaluated


def test_resnet_zero2_from_yaml_then_single_process_evaluation_of_the_consolidated_weights(examples):
    trained, out = examples["resnet"].result()
    first, last = loss_summary(trained)
    assert last < first - 0.5, (first, last)
    accuracy = float(re.search(r"single-process test: test_acc (\d\.\d+)", out)[1])
    assert accuracy > 0.5, out  # chance is 0.1
    assert (examples["resnet"].root / "checkpoints" / "last.pt").is_file()


def test_gpt_in_two_pipeline_stages_then_one_plain_process(examples):
    out = examples["pipeline"].result()
    first, last = loss_summary(out)
    assert last < first - 0.5, (first, last)
    assert "rank 0 held ['blocks', 'wpe', 'wte'] of the GPT's ['blocks', 'lm_head', 'ln_f', 'wpe', 'wte']" in out
    # the sharded pipelined checkpoint, consolidated, loads strictly into a plain module and scores as well
    # on held-out text as the pipelined run did (on other batches of it)
    alone = float(re.search(r"single-process val_loss (\d+\.\d+)", out)[1])
    piped = float(re.search(r"pipelined run: (\d+\.\d+)", out)[1])
    assert abs(alone - piped) < 0.15 and alone < first - 0.5, out[-2000:]


def test_hf_finetune_loads_pretrained_weights_and_exports(examples):
    """A 'pretrained' Llama saved with save_pretrained, fine-tuned at ZeRO-3 + bf16-mixed + activation
    checkpointing from init_weights, exported, reloaded with from_pretrained."""
    out = examples["hf_finetune"].result()
    tmp_path = examples["hf_finetune"].root
    before, after, uniform = map(
        float, re.search(r"val_loss: pretrained (\S+) -> fine-tuned (\S+) \(uniform guess (\S+)\)", out).groups()
    )
    reloaded = float(re.search(r"from_pretrained on one process: val_loss (\S+)", out).group(1))
    assert before < uniform - 0.5, "the fine-tune starts from the pretrained weights, not from scratch"
    assert after < before - 0.1
    assert abs(reloaded - after) < 0.05, "the exported model is the fine-tuned one"
    assert (tmp_path / "exported" / "config.json").is_file()
