"""Pretrained Hugging Face weights into a sharded run and back out, 2 CPU ranks, through Trainer.

A tiny GPT-2 saved with ``save_pretrained`` (one file, and 7 shards with an index) and as a plain
``torch.save`` state_dict loads into a model built in ``configure_model`` (meta device under stage 3): every
rank's rows equal the file's rows, at every stage, in bf16-mixed (fp32 masters) and with offload; the
fine-tuned checkpoint exports to a directory ``from_pretrained`` reads.
"""

import pytest

pytest.importorskip("transformers")

from tests.launch import launch  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from tests.distributed.worker_pretrained import save_pretrained_files

    directory = tmp_path_factory.mktemp("pretrained")
    save_pretrained_files(directory)
    return launch(
        "tests.distributed.worker_pretrained",
        "load",
        "errors",
        "export",
        nprocs=2,
        env={"LZ_SHARED_DIR": str(directory)},
    )


@pytest.mark.parametrize(
    "case",
    ["stage1", "stage2", "stage3", "stage3_sharded_dir", "stage2_plain_file", "stage3_bf16", "stage2_bf16_offload"],
)
def test_each_rank_holds_the_files_rows(report, case):
    result = report["load"][case]
    assert result["checked"] == 28, "every parameter of the tiny GPT-2"
    assert result["diff"] == 0.0
    assert result["tied"], "lm_head.weight is still wte.weight (save_pretrained leaves it out)"
    assert result["steps"] == 3


@pytest.mark.parametrize("stage", [2, 3])
def test_a_mixture_of_experts_in_the_hubs_layout_loads_into_the_fused_experts(report, stage):
    """Mixtral's file holds one tensor per expert (``experts.{e}.w1/w2/w3``), transformers 5's model one per layer
    (``experts.gate_up_proj``): the model's conversion mapping is applied, each rank reading its experts' rows; this
    was a "does not match the model" error."""
    result = report["load"][f"mixtral_stage{stage}"]
    assert result["checked"] == 21, "every parameter of the tiny Mixtral"
    assert result["diff"] == 0.0
    assert result["steps"] == 3


def test_a_meta_built_clip_takes_its_temperature_from_the_files(report):
    """CLIP's 0-dim ``logit_scale`` is set in ``__init__`` only: built on the meta device, no initialiser writes it, and
    without ``init_weights`` that is refused (``test_hf_models.py``); with it, the files' value is checked for instead."""
    result = report["load"]["clip_stage3"]
    assert result["checked"] == len(_clip_parameters())
    assert result["diff"] == 0.0
    assert result["steps"] == 3


def _clip_parameters() -> list[str]:
    from tests.distributed.worker_pretrained import pretrained_model

    return [name for name, _ in pretrained_model("clip").named_parameters()]


def test_missing_and_unexpected_keys_are_listed_on_every_rank(report):
    errors = report["errors"]
    strict = errors["strict"]
    assert strict.startswith("CheckpointError: `init_weights=")
    assert "missing (21): model.lm_head.weight" in strict and "unexpected (28): transformer.h.0" in strict
    assert "init_weights_strict=False" in strict
    assert "under the prefix 'model.transformer.'" in errors["prefix"]
    assert errors["lenient_steps"] == 1, "init_weights_strict=False loads the layers the file has"


def test_a_sharded_checkpoint_directory_starts_a_new_run_at_another_stage(report):
    """``init_weights=`` a directory ZeroStrategy wrote (stage 3, bf16-mixed): the model weights only, each rank
    reading its rows of the saved rows through DCP; every parameter equals the checkpoint's."""
    result = report["export"]["init_from_sharded_checkpoint"]
    assert result["checked"] == 28 and result["diff"] == 0.0 and result["tied"]


def test_finetuned_checkpoint_exports_to_from_pretrained(report):
    result = report["export"]
    assert result["files"] == ["config.json", "model.safetensors"]
    assert result["logits_diff"] <= 1e-5, "the exported model computes the trained module's logits"
    assert result["exported_tied"]
    assert result["half_dtype"] == "torch.bfloat16"
    assert result["half_logits_diff"] <= 2e-2, "gather_16bit_weights_on_save: the same model in bf16"
    # `lightning-zero consolidate CKPT DIR --hf --dtype bf16`
    assert result["command_code"] == 0 and result["command_dtype"] == "torch.bfloat16"
