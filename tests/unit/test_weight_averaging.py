"""The pieces of weight averaging under ZeRO that need no process group: stage 3's mirror of the module and where
a sharded directory puts ``WeightAveraging``'s trained weights. The resumed runs are in
``tests/distributed/test_lightning_features.py``."""

import torch

from lightning_zero.checkpoint.write import split_checkpoint
from lightning_zero.strategy.swa import sharded_mirror


class Tied(torch.nn.Module):
    """Tied input and output weights, a persistent and a non-persistent buffer (a rotary table, a causal mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("inv_freq", torch.arange(3.0), persistent=False)


def test_the_mirror_has_the_module_s_state_dict_names_and_parameter_order():
    module = Tied()
    mirror = sharded_mirror(module)
    assert list(mirror.state_dict()) == list(module.state_dict())  # no "inv_freq": a checkpoint holds none
    assert [n for n, _ in mirror.named_parameters()] == [n for n, _ in module.named_parameters()]
    assert mirror.head.weight is mirror.embed.weight  # tied: averaged once, as the module steps it once
    assert mirror.inv_freq.data_ptr() != module.inv_freq.data_ptr()
    assert all(not p.requires_grad for p in mirror.parameters())


def test_a_sharded_directory_keeps_the_trained_weights_beside_their_average():
    current, average = {"w": torch.ones(2)}, {"w": torch.zeros(2)}
    checkpoint = {
        "state_dict": average,
        "current_model_state": current,
        "averaging_state": {"n_averaged": torch.tensor(3)},
        "epoch": 1,
    }
    tensors, meta = split_checkpoint(checkpoint)
    assert tensors["state_dict"] is average and tensors["current_model_state"] is current
    assert "current_model_state" not in meta and meta["averaging_state"]["n_averaged"] == 3 and meta["epoch"] == 1
