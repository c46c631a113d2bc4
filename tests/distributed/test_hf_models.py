"""Hugging Face GPT-2, BERT, Llama, T5 (encoder-decoder), Mixtral (mixture of experts), ViT (vision) and CLIP
(contrastive, with a 0-dim temperature), tiny configs, under every stage, 2 CPU ranks, through Trainer.

fp32 (2 accumulated micro-batches per step, activation checkpointing on each library's block class: T5's crashed
with ``CheckpointError`` until its cache was turned off for training) against plain single-process PyTorch; bf16-mixed against a single-process emulation of
the same mixed arithmetic (``mixed_reference.py``). Every run: clipping by norm, 2 param groups, a warmup
schedule, 3 optimizer steps.
"""

import pytest

transformers = pytest.importorskip("transformers")

from tests.distributed.worker_hf_models import DEFAULT, MATRIX, META_KINDS, key  # noqa: E402
from tests.launch import launch  # noqa: E402
from tests.tolerances import assert_as_reference  # noqa: E402

WORLD = 2
pytestmark = pytest.mark.slow
#: transformers 4 (``make test-torch``'s oldest Lightning entry runs the floor, 4.57) gives some models constant
#: buffers that its ``_init_weights`` does not set (GPT-2's ``masked_bias``): built on the meta device, they are refused.
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5


@pytest.fixture(scope="module")
def report():
    return launch("tests.distributed.worker_hf_models", "default", nprocs=WORLD)["default"]


@pytest.fixture(scope="module")
def full_report():
    return launch("tests.distributed.worker_hf_models", "full", nprocs=WORLD)["full"]


def check(name: str, result: dict, precision: str) -> None:
    assert result["steps"] == 3, name
    assert result["change"] > 1e-3, f"{name}: the reference must move the parameters"
    assert_as_reference(name, result, precision)
    if name.startswith("gpt2"):
        assert result["tied"], f"{name}: lm_head and wte stay tied"
    assert result["use_cache_kept"], f"{name}: the model's own use_cache settings are back after fit"


@pytest.mark.parametrize("kind, stage", [(c[0], c[1]) for c in DEFAULT if c[2:] == ("32-true", True)])
def test_fp32_with_activation_checkpointing_equals_plain_pytorch(report, kind, stage, record_property):
    record_property("max |dparam| vs plain PyTorch", report[key(kind, stage, "32-true", True)]["diff"])
    check(key(kind, stage, "32-true", True), report[key(kind, stage, "32-true", True)], "32-true")


@pytest.mark.parametrize("kind, stage", [(c[0], c[1]) for c in DEFAULT if c[2:] == ("bf16-mixed", False)])
def test_bf16_mixed_masters_equal_the_single_process_emulation(report, kind, stage):
    check(key(kind, stage, "bf16-mixed", False), report[key(kind, stage, "bf16-mixed", False)], "bf16-mixed")


@pytest.mark.parametrize("kind", META_KINDS)
def test_built_in_configure_model_under_stage_3_gets_the_library_initialisation(report, kind):
    """Meta device, then each unit materialised sharded with ``_init_weights``: every deterministic tensor
    (norms, biases, zeroed rows, rotary and position buffers) equals an eager build; every random one has the
    library's distribution (GPT-2's residual projections at 0.02 / sqrt(2 n_layer))."""
    result = report[f"{kind}/meta_init"]
    if TRANSFORMERS_4 and "error" in result:
        assert result["error"].startswith("Cannot materialise the meta-device model: ["), result["error"]
        assert "init_weights=" in result["error"]  # the way out is named
        return
    assert result["steps"] == 2
    assert result["not_equal"] == []
    assert result["spread"], "the model has random weights"
    for name, (std, eager_std, abs_mean, numel) in result["spread"].items():
        # Two sample standard deviations of n draws each differ by about sqrt(2) / sqrt(2n): allow 5 of that.
        assert std == pytest.approx(eager_std, rel=5 / numel**0.5), name
        assert abs_mean <= 4 * eager_std / numel**0.5, name
    if kind == "gpt2":
        assert result["tied"], "lm_head.weight is still wte.weight"


def test_a_constant_that_no_initialiser_sets_is_refused_on_the_meta_device_naming_it(report):
    """CLIP's ``logit_scale`` is set from the config in ``__init__`` and in no ``_init_weights``: built on the meta
    device it would train from uninitialised memory."""
    message = report["clip/meta_init"]["error"]
    assert "CLIPModel (model.logit_scale)" in message
    assert "a value given in `__init__`" in message


def test_t5_stage_3_difference_is_fsdp2_summing_per_unit(report):
    """See ``fsdp2_association`` in the worker: plain PyTorch with FSDP2's identity nodes equals FSDP2 bit for bit."""
    result = report["t5/fsdp2_association"]
    assert result["plain_vs_fsdp2"] > 0
    assert result["identity_vs_fsdp2"] == 0


@pytest.mark.full
def test_the_rest_of_the_matrix(full_report):
    assert sorted(full_report) == sorted(key(*c) for c in MATRIX if c not in DEFAULT)
    for configuration in MATRIX:
        if configuration not in DEFAULT:
            check(key(*configuration), full_report[key(*configuration)], configuration[2])
