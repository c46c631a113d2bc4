"""Reading pretrained weights (no processes): formats, one rank's rows, key matching and its errors."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.verify import CheckpointError
from lightning_zero.deepspeed_compat.config import parse_deepspeed_config
from lightning_zero.checkpoint.hf_export import parse_size, write_hf_dir
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
    out = write_hf_dir(iter(tensors), {"prefix": "model.", "config": {"model_type": "x"}, "class": "X"}, tmp_path / "hf",
                       dtype=torch.bfloat16, max_shard_size=1024)
    names = sorted(p.name for p in out.iterdir())
    assert names[-1] == "model.safetensors.index.json" and len(names) == 2 + 2  # config, 2 shards, index
    source = WeightsFile(out)
    assert sorted(source.keys()) == [f"layer{i}.weight" for i in range(4)]
    assert source.full("layer3.weight").dtype == torch.bfloat16
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20


@pytest.mark.parametrize(
    "key", ["gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save"],
)
def test_deepspeed_16bit_save_keys_in_every_spelling(key):
    config = {"zero_optimization": {"stage": 3, key: True}}
    assert parse_deepspeed_config(config).strategy["gather_16bit_weights_on_save"] is True
    assert ZeroStrategy(config=config).zero_config.gather_16bit_weights_on_save is True
