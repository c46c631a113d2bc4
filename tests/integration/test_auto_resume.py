"""Kill -9 (or SIGTERM) a rank under ``torchrun --max-restarts``: torchrun restarts the job, ZeroStrategy resumes it
from the newest complete checkpoint by itself, and the run ends exactly where an uninterrupted one does -- same
parameters, and every step saw the same samples and the same RNG state (dropout) as the uninterrupted run's step
of the same epoch and batch. One torchrun job runs several cases: each case's fault uses up one restart
(see worker_auto_resume.py). torchrun runs with torch's defaults (the agent's store shared by every attempt), and
the restarted rank 1 starts late (``LATE_RESTART``), which is when an earlier attempt's keys in that store broke
the restart (lightning_zero/strategy/attempt_store.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration import background
from tests.integration.torchrun import torchrun

pytestmark = pytest.mark.slow

WORKER = "tests.integration.worker_auto_resume"

#: (kill, accumulate) -> (epoch, batch) of the first batch the resumed attempt trains on: where the newest
#: complete checkpoint at the fault leaves off (see KILL_AT / CHECKPOINT_EVERY in the worker).
RESUMES_AT = {
    ("step", 1): (1, 0),
    ("step", 2): (1, 0),  # the epoch-0 end checkpoint; killed in epoch 1, batch 3
    ("epoch", 1): (0, 6),
    ("epoch", 2): (0, 8),  # a mid-epoch checkpoint; killed later in the epoch
    ("save", 1): (0, 3),
    ("save", 2): (0, 4),  # killed writing the step-6 (step-3) checkpoint: the one before
    ("sigterm", 1): (0, 8),
    ("sigterm", 2): (0, 8),  # sigterm.ckpt, taken after batch 7
    ("node", 1): (0, 6),  # as "epoch", with one rank per torchrun agent
}

DEFAULT = ["s2-f32-a2-epoch"]
#: kill -9 inside a step and while writing a checkpoint, at stages 2 and 3, five times each.
REPEATED = [
    f"s{2 + (rep + save) % 2}-f32-a1-{'save' if save else 'step'}-{rep}" for rep in range(1, 6) for save in (0, 1)
]
#: The other kill points; a kill inside a step or a save at stages 2-3 without accumulation is REPEATED's.
FULL = [
    "s2-f32-a1-epoch",
    "s3-f32-a2-epoch",
    "s3-f32-a2-save",
    "s2-f16-a2-epoch",
    "s3-f16-a1-save",
    "s2-f32-a1-sigterm",
    "s3-f32-a2-sigterm",
]


def run(directory: Path, cases: list[str], timeout: float, nnodes: int = 1, late: float = 0.0) -> dict:
    result = torchrun(
        WORKER,
        str(directory),
        *cases,
        nprocs=2 // nnodes,
        nnodes=nnodes,
        max_restarts=len(cases),
        timeout=timeout,
        env={"LATE_RESTART": str(late)},
    )
    (directory / "torchrun.log").write_text(result.output)  # kept with the run's files, to read when it fails
    assert result.returncode == 0, result.output[-8000:]
    return {"output": result.output, "seconds": result.seconds, **{case: compare(directory, case) for case in cases}}


def compare(directory: Path, case: str) -> dict:
    """The faulted and resumed run of ``case`` against its uninterrupted reference, step by step."""
    stage, precision, accumulate, fault, *_ = case.split("-")
    reference_dir = directory / f"reference-{stage}-{precision}-{accumulate}"
    reference, resumed = torch.load(reference_dir / "reference.pt"), torch.load(directory / case / "run.pt")
    param_diff = max(
        (reference["params"][k].double() - resumed["params"][k].double()).abs().max().item()
        for k in reference["params"]
    )
    steps = {"same_data": True, "same_rng": True, "covered": True, "processes": [], "resumed_at": [], "restarts": []}
    for rank in (0, 1):
        expected = {(r["epoch"], r["batch"]): r for r in _records(reference_dir / f"steps-reference-rank{rank}.jsonl")}
        records = _records(directory / case / f"steps-run-rank{rank}.jsonl")
        for r in records:
            ref = expected[(r["epoch"], r["batch"])]
            steps["same_data"] &= r["samples"] == ref["samples"]
            steps["same_rng"] &= r["rng"] == ref["rng"]
        steps["covered"] &= set(expected) <= {(r["epoch"], r["batch"]) for r in records}
        pids = list(dict.fromkeys(r["pid"] for r in records))  # this rank's processes, in order
        last_process = [r for r in records if r["pid"] == pids[-1]]
        steps["processes"].append(len(pids))
        steps["resumed_at"].append((last_process[0]["epoch"], last_process[0]["batch"]))
        steps["restarts"].append(last_process[0]["restarts"])  # the restarted process's TORCHELASTIC_RESTART_COUNT
    return {
        "param_diff": param_diff,
        "global_step": (reference["global_step"], resumed["global_step"]),
        "scale": (reference["scale"], resumed["scale"]),
        **steps,
        "expected_resume": RESUMES_AT[(fault, int(accumulate[1:]))],
    }


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check(result: dict, case: str) -> None:
    outcome = result[case]
    assert outcome["processes"] == [2, 2], outcome  # faulted in one process, resumed after torchrun's restart
    assert outcome["resumed_at"] == [outcome["expected_resume"]] * 2  # newest *complete* checkpoint, mid-epoch exactly
    assert outcome["same_data"] and outcome["covered"]  # every batch the uninterrupted run saw, in the same order
    assert outcome["same_rng"]  # dropout masks drawn from the same RNG state at every step
    assert outcome["global_step"][0] == outcome["global_step"][1]
    assert outcome["scale"][0] == outcome["scale"][1]  # 16-mixed: the loss scaler's state was restored
    assert outcome["param_diff"] <= 1e-5


background.register("auto_resume", lambda root: run(root, DEFAULT, timeout=600, late=15))


@pytest.fixture(scope="module")
def default(runs):
    return runs.get("auto_resume").result()


@pytest.mark.parametrize("case", DEFAULT)
def test_a_killed_rank_is_restarted_and_resumes_exactly(default, case):
    check(default, case)
    assert "[worker] rank 1 SIGKILLs itself" in default["output"]
    assert "Auto-resume: restart 1 of this job; resuming from" in default["output"]
    assert default[case]["restarts"] == [1, 1]  # both processes were restarted by torchrun
    assert "[worker] rank 1 starts 15 s late" in default["output"]


background.register("auto_resume_full", lambda root: run(root, FULL, timeout=1800), full=True)


@pytest.fixture(scope="module")
def full(runs):
    return runs.get("auto_resume_full").result()


@pytest.mark.full
@pytest.mark.parametrize("case", FULL)
def test_every_kill_point_resumes_exactly(full, case):
    check(full, case)


background.register("auto_resume_repeated", lambda root: run(root, REPEATED, timeout=1800, late=10), full=True)


@pytest.fixture(scope="module")
def repeated(runs):
    return runs.get("auto_resume_repeated").result()


@pytest.mark.full
@pytest.mark.parametrize("case", REPEATED)
def test_kills_inside_a_step_and_a_save_resume_exactly_every_time(repeated, case):
    check(repeated, case)
    assert repeated["output"].count("starts 10 s late") == len(REPEATED)


@pytest.mark.full
def test_faults_happened_where_intended(full):
    output = full["output"]
    saves = sum(case.split("-")[3] == "save" for case in FULL)
    assert (
        output.count("SIGKILLs itself while writing") == saves
    )  # mid-save: inside the checkpoint's temporary directory
    assert output.count("SIGTERM: saved") == 2 and "SIGTERM: no checkpoint taken" not in output
    assert f"[worker] rank 0 done (TORCHELASTIC_RESTART_COUNT={len(FULL)})" in output


@background.in_background
def test_a_node_whose_restart_torchrun_did_not_count_resumes_too(tmp_path):
    """Two torchrun agents (nodes), one rank each. Rank 0 is killed while rank 1 sits outside any collective, as an
    NCCL peer that notices nothing: agent 0 restarts its worker as restart 1, agent 1 restarts its own for the
    membership change with TORCHELASTIC_RESTART_COUNT still 0 -- and that rank must resume too (the checkpoint
    records the job that wrote it)."""
    # 304 s in one `make test-all` (three background runs beside it): the limit catches a hang, not a slow machine.
    result = run(tmp_path, ["s2-f32-a1-node"], timeout=900, nnodes=2)
    check(result, "s2-f32-a1-node")
    assert result["s2-f32-a1-node"]["restarts"] == [1, 0]
