"""Long sequences inside ``lightning.Trainer`` on 2 CPU ranks (gloo): activation offload and tiled compute give the
numbers of the run without them, at ZeRO stages 1-3."""

import pytest

from tests.launch import launch
from tests.tolerances import reordered_fp32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offload():
    return launch("tests.distributed.worker_long_context", "offload", nprocs=2)["offload"]


@pytest.mark.parametrize("case", ["stage1", "stage2", "stage3", "stage3_bf16_offloaded_params"])
def test_offloaded_activations_train_as_checkpointing_alone(offload, case):
    """A dropout GPT (3 steps of 2 accumulated micro-batches, clipped) with its checkpointed blocks' inputs on the
    host ends where the run keeping them on the device ends (at stage 3 also under bf16-mixed with the parameters
    offloaded); every rank moved each block's input of each micro-batch to the host once and back once, all but the
    first recomputed one fetched ahead, and freed them."""
    result = offload[case]
    assert result["trained"] == 3
    # the same bytes recomputed; a copy in other memory may pick another kernel: reordered fp32 at most
    assert result["param_diff"] <= reordered_fp32(result["lr"], result["steps"]), result["param_diff"]
    for statistics in result["statistics"]:
        assert statistics["offloaded_bytes"] == result["expected_offloaded"]
        assert statistics["fetched_bytes"] == result["expected_offloaded"]
        assert statistics["prefetched_bytes"] == result["expected_prefetched"]
        assert statistics["host_bytes"] == 0


@pytest.fixture(scope="module")
def tiled():
    return launch("tests.distributed.worker_long_context", "tiled", nprocs=2)["tiled"]


@pytest.mark.parametrize("case", ["llama_stage1", "llama_stage2", "llama_stage3", "gpt2_stage3", "mixtral_stage2"])
def test_tiled_compute_trains_a_hugging_face_causal_lm_as_untiled(tiled, case):
    """A tiny HF causal LM (Llama, GPT-2 with its Conv1D MLP, Mixtral whose experts stay whole) computing its loss
    from ``labels`` with masked positions, trained with ``tiled_compute=5`` (tiles of 5 of 12 positions) and
    without: the same parameters up to the order of fp32 sums; no training step saw logits; nothing stays wrapped
    after ``fit``."""
    result = tiled[case]
    assert result["trained"] == 2
    assert result["param_diff"] <= reordered_fp32(result["lr"], result["steps"]), result["param_diff"]
    assert result["logits_seen"] == [False] * 4
    assert result["left_wrapped"] == []


def test_checkpointing_offload_and_tiles_together_train_as_plain(tiled):
    """Llama at stage 3 with its decoder layers checkpointed, their inputs offloaded and tiled compute, against the
    run with none of them."""
    result = tiled["everything_stage3"]
    assert result["offloaded_bytes"] > 0
    assert result["param_diff"] <= reordered_fp32(result["lr"], result["steps"]), result["param_diff"]
