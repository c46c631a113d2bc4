"""Reading pretrained weights (no processes): formats, one rank's rows, key matching and its errors."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.hf_export import parse_size, write_hf_dir
from lightning_zero.checkpoint.verify import CheckpointError
from lightning_zero.deepspeed_compat.config import parse_deepspeed_config
from lightning_zero.pretrained import WeightsFile, detect_prefix, load_pretrained, match_keys


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
        self.head = nn.Linear(5, 5, bias=False)


def saved(tmp_path, fmt: str):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    path = tmp_path / ("w.safetensors" if fmt == "safetensors" else "w.pt")
    if fmt == "safetensors":
        save_file(state, str(path))
    elif fmt == "lightning":
        torch.save({"state_dict": state, "epoch": 3}, path)
    else:
        torch.save(state, path)
    return path, state


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "lightning"])
def test_rows_are_the_dim0_shard_of_each_rank(tmp_path, fmt):
    path, state = saved(tmp_path, fmt)
    source = WeightsFile(path)
    assert sorted(source.keys()) == sorted(state)
    weight = state["0.weight"]  # 5 rows over 2 ranks: 3 and 2
    assert torch.equal(source.rows("0.weight", 0, 2), weight[:3])
    assert torch.equal(source.rows("0.weight", 1, 2), weight[3:])
    assert source.shape("0.weight") == weight.shape


def test_prefix_detection_and_plain_loading(tmp_path):
    path, state = saved(tmp_path, "safetensors")
    module = Wrapper()
    assert detect_prefix(module, list(state)) == "net."
    with pytest.raises(CheckpointError, match=r"missing \(5\): head.weight.*\n.*unexpected \(4\): 0.bias"):
        load_pretrained(module, path, prefix="")
    # Strict within the submodule the prefix names; no engine, no process group: a plain module.
    assert load_pretrained(module, path) == {f"net.{k}": k for k in state}
    assert torch.equal(module.net[0].weight, state["0.weight"])


def test_shape_mismatch_is_always_an_error(tmp_path):
    path, _ = saved(tmp_path, "torch")
    module = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(5))
    with pytest.raises(CheckpointError, match=r"mismatched shapes.*0.weight: file \(5, 3\) vs model \(4, 3\)"):
        match_keys(module, WeightsFile(path), strict=False)


def test_a_directory_without_weights_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        WeightsFile(tmp_path)


def test_sharded_export_reads_back(tmp_path):
    tensors = [(f"model.layer{i}.weight", torch.full((256,), float(i))) for i in range(4)]
    out = write_hf_dir(
        iter(tensors),
        {"prefix": "model.", "config": {"model_type": "x"}, "class": "X"},
        tmp_path / "hf",
        dtype=torch.bfloat16,
        max_shard_size=1024,
    )
    names = sorted(p.name for p in out.iterdir())
    assert names[-1] == "model.safetensors.index.json" and len(names) == 2 + 2  # config, 2 shards, index
    source = WeightsFile(out)
    assert sorted(source.keys()) == [f"layer{i}.weight" for i in range(4)]
    assert source.full("layer3.weight").dtype == torch.bfloat16
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20


@pytest.mark.parametrize(
    "key",
    [
        "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
    ],
)
def test_deepspeed_16bit_save_keys_in_every_spelling(key):
    config = {"zero_optimization": {"stage": 3, key: True}}
    assert parse_deepspeed_config(config).strategy["gather_16bit_weights_on_save"] is True
    assert ZeroStrategy(config=config).zero_config.gather_16bit_weights_on_save is True


def _hugging_face(kind: str):
    transformers = pytest.importorskip("transformers")
    if kind == "vit":  # renamed on loading (`encoder.layer.N.attention.attention.query` -> `layers.N.attention.q_proj`)
        config = transformers.ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=3,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=3,
        )
        return transformers.ViTForImageClassification, config
    config = transformers.MixtralConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,  # experts fused
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=3,
    )
    return transformers.MixtralForCausalLM, config


@pytest.mark.parametrize("kind", ["vit", "mixtral"])
def test_a_files_layout_that_transformers_converts_on_loading_is_converted_row_by_row(tmp_path, kind):
    """``save_pretrained`` writes the Hub's layout, which transformers 5 renames or fuses on loading: the same
    conversion applies, every tensor loads, and each rank's rows of a fused tensor are those of the whole."""
    from lightning_zero.pretrained.conversion import hugging_face_view

    cls, config = _hugging_face(kind)
    torch.manual_seed(0)
    original = cls(config)
    original.save_pretrained(tmp_path)
    torch.manual_seed(1)
    module = nn.Module()
    module.model = cls(config)
    loaded = load_pretrained(module, tmp_path)
    assert len(loaded) == len(original.state_dict())
    for (name, want), got in zip(original.state_dict().items(), module.model.state_dict().values()):
        assert torch.equal(want, got), name
    view = hugging_face_view(module, WeightsFile(tmp_path))
    for key in view.keys():
        assert torch.equal(
            torch.cat([view.rows(key, rank, 2) for rank in range(2)]).reshape(view.shape(key)), view.full(key)
        )
