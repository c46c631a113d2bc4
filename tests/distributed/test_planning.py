"""The memory planner against real 2-rank runs through lightning.Trainer (gloo): the predicted peak per rank of a
traced step against the measured peak of live tensor bytes, for a matrix of 24 configurations of the demo GPT and
ResNet, and the planner's pick under three budgets trained for real within them."""

import pytest

from tests.distributed.worker_planning import BUDGETS_MIB, CASES
from tests.launch import launch

pytestmark = pytest.mark.slow
BOUND = 0.10


@pytest.fixture(scope="module")
def report():
    return launch("tests.distributed.worker_planning", "calibration", "budget", nprocs=2)


def test_the_matrix_covers_what_the_planner_weighs():
    cases = list(CASES.values())
    assert len(cases) >= 24
    assert {c[0] for c in cases} == {"gpt", "resnet"} and {c[1] for c in cases} == {1, 2, 3}
    assert {c[2] for c in cases} == {"32-true", "bf16-mixed"} and {c[4] for c in cases} == {False, True}
    assert {c[5] for c in cases} == {0.0, 0.5, 1.0} and any(c[6] for c in cases)
    assert all(len({c[3] for c in cases if c[0] == model}) >= 2 for model in ("gpt", "resnet"))  # two batch sizes


def test_predicted_peak_is_within_ten_percent_of_the_measured_one(report):
    """On a CPU run device and host are one memory: the prediction compared is the device peak plus what it puts on
    the host (offloaded state, always alive)."""
    rows = report["calibration"]
    assert set(rows) == set(CASES)
    print(f"\n{'case':34s}{'measured MB':>13}{'predicted MB':>14}{'error':>8}")
    errors = {}
    for name, row in rows.items():
        predicted = row["predicted"] + row["host"]
        errors[name] = predicted / row["measured"] - 1
        print(f"{name:34s}{row['measured'] / 1e6:>13.2f}{predicted / 1e6:>14.2f}{errors[name] * 100:>+7.1f}%")
    assert all(abs(e) <= BOUND for e in errors.values()), {k: e for k, e in errors.items() if abs(e) > BOUND}


@pytest.mark.parametrize("mib", [str(b) for b in BUDGETS_MIB])
def test_the_planners_pick_runs_within_its_budget(report, mib):
    row = report["budget"][mib]
    assert row["host"] == 0, "a pick that offloads cannot be checked against a device budget on a CPU-only run"
    assert row["measured"] <= row["budget"]
    assert abs(row["predicted"] / row["measured"] - 1) <= BOUND
    assert row["micro_batch"] * row["accumulate"] == 16  # the global batch is kept


def test_smaller_budgets_pick_leaner_configurations(report):
    picks = [report["budget"][str(b)] for b in BUDGETS_MIB]
    assert len({(p["configuration"], p["micro_batch"]) for p in picks}) == len(BUDGETS_MIB)
    assert [p["predicted"] for p in picks] == sorted((p["predicted"] for p in picks), reverse=True)
