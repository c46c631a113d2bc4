"""Lightning conformance: every built-in callback and the Trainer flags users combine with a strategy, on the same
module under Lightning ``ddp`` and each ZeRO stage (2 CPU ranks). A feature conforms when it does what it does under
``ddp``: the same outcome (or the same refusal), the same stopping point, metrics, files and weights. The README's
"Lightning features" table is this test's matrix."""

import math

import pytest

from tests.distributed.worker_conformance import FEATURES, REPRESENTATIVE, STAGE3_ONLY
from tests.launch import launch

pytestmark = pytest.mark.slow
#: Features whose outcome depends on wall time (steps done before ``max_time``): compared by behaviour only.
TIMED = {"max_time"}


@pytest.fixture(scope="module")
def representative(tmp_path_factory):
    env = {"LZ_SHARED_DIR": str(tmp_path_factory.mktemp("conformance"))}
    return launch("tests.distributed.worker_conformance", "representative", nprocs=2, env=env)["representative"]


@pytest.fixture(scope="module")
def rest(tmp_path_factory):
    env = {"LZ_SHARED_DIR": str(tmp_path_factory.mktemp("conformance_rest"))}
    return launch("tests.distributed.worker_conformance", "rest", nprocs=2, env=env, timeout=900)["rest"]


def _conforms(feature: str, runs: dict) -> None:
    ddp = runs["ddp"]
    assert len(runs) > 1, f"{feature}: no ZeRO stage ran"
    for stage, run in runs.items():
        if stage == "ddp":
            continue
        assert run["error"] == ddp["error"], f"{feature} under {stage}: {run['error']} (ddp: {ddp['error']})"
        if run["error"] is not None:
            continue
        if feature in TIMED:
            assert run["epoch"] < 1000 and run["step"] > 0, "max_time must stop training"
            continue
        assert (run["step"], run["epoch"], run["files"]) == (ddp["step"], ddp["epoch"], ddp["files"]), stage
        assert run["metrics"].keys() == ddp["metrics"].keys()
        assert all(math.isclose(run["metrics"][k], ddp["metrics"][k], abs_tol=1e-5) for k in ddp["metrics"]), stage
        assert run["weights_diff_vs_ddp"] <= 1e-5, stage
        extras = {k for k in ddp if k not in ("error", "step", "epoch", "metrics", "files", "weights_diff_vs_ddp")}
        for key in extras:
            if key.endswith("_diff_vs_ddp"):
                assert run[key] <= 1e-5, (stage, key)
            elif isinstance(ddp[key], float):
                assert math.isclose(run[key], ddp[key], abs_tol=1e-5), (stage, key)
            else:
                assert run[key] == ddp[key], (stage, key)


@pytest.mark.parametrize("feature", REPRESENTATIVE)
def test_lightning_feature_conforms_to_ddp(representative, feature):
    _conforms(feature, representative[feature])


@pytest.mark.full
@pytest.mark.parametrize("feature", [feature for feature in FEATURES if feature not in STAGE3_ONLY])
def test_more_lightning_features_conform_to_ddp(rest, feature):
    """The other features at every stage, and the representative ones at their other stages."""
    _conforms(feature, rest[feature])


def test_refusals_say_why(representative):
    """Lightning refuses batch-size tuning for every distributed strategy; ZeroStrategy follows it, with its message."""
    for run in representative["batch_size_finder"].values():
        assert "not supported with distributed strategies" in run["error"]


def test_gradient_norms_are_logged_as_under_ddp(representative):
    """``lightning_zero.grad_norm`` in ``on_before_optimizer_step``: the keys and values of Lightning's ``grad_norm``
    under ``ddp`` (compared above), every parameter of the model among them."""
    for stage, run in representative["grad_norm"].items():
        norms = [k for k in run["metrics"] if k.startswith("grad_2.0_norm")]
        assert "grad_2.0_norm_total" in norms and len(norms) > 10, (stage, norms)
