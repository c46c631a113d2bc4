"""What a user runs prints what it means and nothing else (issue 36, item 10): the quickstart's model raises no
warning of its own, and `lightning-zero consolidate`, which runs in one process on purpose, does not warn that
torch.distributed is uninitialised."""

from __future__ import annotations

import gc
import importlib.util
import warnings

import torch

from lightning_zero.checkpoint.write import save_sharded
from lightning_zero.cli import main
from tests.launch import REPO


def test_the_quickstart_model_raises_no_warning_of_its_own():
    spec = importlib.util.spec_from_file_location("quickstart", REPO / "examples" / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    model = quickstart.SpiralClassifier(width=8)
    points, labels = quickstart.spirals(32).tensors
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.training_step((points, labels), 0)  # self.log outside a Trainer warns from Lightning: not ours
    ours = [w for w in caught if w.filename.endswith("quickstart.py")]
    assert ours == [], [str(w.message) for w in ours]
    assert isinstance(model.first_loss, float)


def test_consolidate_prints_no_distributed_warning(tmp_path, capsys):
    src, dst = tmp_path / "sharded.ckpt", tmp_path / "model.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the writer's own single-process notice is not what is tested here
        save_sharded({"state_dict": {"w": torch.arange(12.0).reshape(4, 3)}, "global_step": 1}, src)
    gc.collect()  # an earlier test's unclosed file, finalised here, is not what this command prints
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["consolidate", str(src), str(dst)]) == 0
    assert [str(w.message) for w in caught] == []
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote {dst} (") and err == ""
    assert torch.equal(torch.load(dst, weights_only=True)["w"], torch.arange(12.0).reshape(4, 3))
