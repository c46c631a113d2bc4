"""Activation offload (``offload_activations=True``, DeepSpeed's ``cpu_checkpointing``): checkpointed inputs kept on
the host give the same gradients as checkpointing alone, the device keeps none of them, and the settings that ask for
it or cannot have it say so (one process; the Trainer runs are in ``tests/distributed/test_long_context.py``)."""

import copy

import pytest
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.activation_checkpointing import (
    ActivationCheckpointingError,
    activation_offload,
    apply_activation_checkpointing,
    resolve_policy,
)
from lightning_zero.config import ZeroConfigError
from lightning_zero.demo.gpt import GPT, Block, GPTConfig
from lightning_zero.planning.accounting import saved_tensor_bytes
from tests.unit.test_activation_checkpointing import loss_of

CONFIG = GPTConfig(vocab_size=65, block_size=32, n_layer=4, n_head=4, n_embd=32, dropout=0.1)


def gpt(offload: bool | None) -> GPT:
    """The GPT, its blocks checkpointed (``offload`` True or False) or not (None)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if offload is not None:
        apply_activation_checkpointing(model, resolve_policy(Block, offload=offload))
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def gradients(model: nn.Module, seed: int = 5) -> dict[str, torch.Tensor]:
    x, y = batch()
    torch.manual_seed(seed)  # the same dropout masks in every run
    loss_of(model, x, y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_offloaded_inputs_give_the_gradients_of_checkpointing_bit_for_bit():
    reference, checkpointed, offloaded = gradients(gpt(None)), gradients(gpt(False)), gradients(gpt(True))
    for name, grad in offloaded.items():
        assert torch.equal(grad, checkpointed[name]), name
        assert torch.equal(grad, reference[name]), name


def test_every_block_input_goes_to_the_host_and_comes_back_once_the_rest_one_block_ahead():
    model = gpt(True)
    gradients(model)
    statistics = activation_offload(model).statistics
    block_input = 4 * CONFIG.block_size * CONFIG.n_embd * 4  # (B, T, C) fp32
    assert statistics.offloaded_bytes == CONFIG.n_layer * block_input
    assert statistics.fetched_bytes == statistics.offloaded_bytes
    # the last block's recomputation is backward's first: it fetches at once, every other block was fetched ahead
    assert statistics.prefetched_bytes == (CONFIG.n_layer - 1) * block_input
    assert statistics.peak_host_bytes == CONFIG.n_layer * block_input
    assert statistics.host_bytes == 0  # freed with the graph


def test_the_graph_keeps_no_block_input_on_the_device():
    """What autograd keeps for backward: checkpointing keeps each block's input, offload none of them."""
    x, y = batch()
    kept = {}
    for offload in (False, True):
        model = gpt(offload)
        with saved_tensor_bytes(exclude=model.parameters()) as saved:
            loss_of(model, x, y)
        kept[offload] = saved["bytes"]
    block_input = x.numel() * CONFIG.n_embd * 4
    assert kept[False] - kept[True] == CONFIG.n_layer * block_input


def test_a_second_backward_through_the_graph_fetches_again():
    """A gradient penalty differentiates the forward twice: each recomputation takes its inputs from the host."""
    grads = {}
    for offload in (False, True):
        model = gpt(offload)
        x, y = batch()
        torch.manual_seed(5)
        loss = loss_of(model, x, y)
        (penalty,) = torch.autograd.grad(loss, model.wte.weight, create_graph=True)  # through every block
        (loss + penalty.pow(2).sum()).backward()
        grads[offload] = {name: p.grad for name, p in model.named_parameters()}
    for name, grad in grads[True].items():
        assert torch.equal(grad, grads[False][name]), name
    assert (
        activation_offload(model).statistics.fetched_bytes == 2 * activation_offload(model).statistics.offloaded_bytes
    )


class Gated(nn.Module):
    """A block taking its hidden state as a keyword and a mask shared by every block."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, *, hidden: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden) + bias) * mask


def test_only_inputs_that_require_grad_move_and_keywords_count():
    """Each block's hidden state moves; the mask (no grad) stays; a bias every block takes (as T5's position bias)
    moves once, with the first block."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Gated() for _ in range(3))
    plain = copy.deepcopy(blocks)
    apply_activation_checkpointing(blocks, resolve_policy(Gated, offload=True))
    hidden, mask = torch.randn(2, 8, requires_grad=True), torch.ones(2, 8)
    scale = torch.randn(8, requires_grad=True)
    for stack in (blocks, plain):
        out, bias = hidden, scale * 2  # a tensor computed once a step, shared by the blocks
        for block in stack:
            out = block(hidden=out, mask=mask, bias=bias)
        out.sum().backward()
    for a, b in zip(blocks.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert activation_offload(blocks).statistics.offloaded_bytes == 3 * hidden.numel() * 4 + scale.numel() * 4


def test_nothing_moves_without_grad():
    model = gpt(True)
    with torch.no_grad():
        model(batch()[0])
    assert activation_offload(model).statistics.offloaded_bytes == 0


def test_the_settings_that_ask_for_it():
    assert ZeroStrategy(activation_checkpointing=Block, offload_activations=True).checkpoint_policy.offload
    assert not ZeroStrategy(activation_checkpointing=Block).checkpoint_policy.offload
    assert resolve_policy({"classes": [Block], "cpu_checkpointing": True}).offload
    deepspeed = {"zero_optimization": {"stage": 2}, "activation_checkpointing": {"cpu_checkpointing": True}}
    assert ZeroStrategy(config=deepspeed, activation_checkpointing=Block).checkpoint_policy.offload


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"offload_activations": True}, ZeroConfigError, "set `activation_checkpointing=` too"),
        ({"offload_activations": 1, "activation_checkpointing": Block}, ZeroConfigError, "must be True or False"),
        (
            {"activation_checkpointing": {"classes": [Block], "partition_activations": True}},
            ActivationCheckpointingError,
            "no tensor parallelism",
        ),
        (
            {"activation_checkpointing": {"classes": [Block], "cpu_checkpointing": "yes"}},
            ActivationCheckpointingError,
            "cpu_checkpointing must be true or false",
        ),
    ],
)
def test_settings_it_cannot_have_fail_when_the_strategy_is_built(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        ZeroStrategy(stage=2, **kwargs)
