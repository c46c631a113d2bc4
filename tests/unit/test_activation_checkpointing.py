"""Activation checkpointing policies, names, exactness and the activation memory saved (one process)."""

import copy

import pytest
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.activation_checkpointing import (
    ActivationCheckpointingError,
    apply_activation_checkpointing,
    resolve_policy,
)
from lightning_zero.demo.gpt import GPT, Block, GPTConfig
from lightning_zero.planning.accounting import saved_tensor_bytes

CONFIG = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=64, dropout=0.1)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CONFIG.vocab_size, (8, CONFIG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def loss_of(model, x, y):
    logits = model(x)
    return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


@pytest.mark.parametrize(
    "spec",
    [Block, {Block}, [Block], "lightning_zero.demo.gpt.Block", lambda m: isinstance(m, Block),
     {"classes": ["lightning_zero.demo.gpt.Block"]}, {"classes": Block, "every": 1}],
)
def test_every_policy_form_selects_the_blocks(spec):
    names = apply_activation_checkpointing(gpt(), resolve_policy(spec))
    assert names == [f"blocks.{i}" for i in range(CONFIG.n_layer)]


def test_every_k_and_nested_matches():
    model = gpt()
    assert apply_activation_checkpointing(model, resolve_policy({"classes": [Block], "every": 2})) == ["blocks.0", "blocks.2"]
    # a policy that also matches modules inside a chosen block checkpoints the outer one only
    names = apply_activation_checkpointing(gpt(), resolve_policy([Block, nn.Linear]))
    assert "blocks.0" in names and not any(n.startswith("blocks.0.") for n in names)


def test_names_and_state_dict_keys_are_unchanged():
    plain, checkpointed = gpt(), gpt()
    apply_activation_checkpointing(checkpointed, resolve_policy(Block))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    assert list(plain.state_dict()) == list(checkpointed.state_dict())
    assert not any("checkpoint" in key for key in checkpointed.state_dict())


def test_policy_matching_nothing_warns_with_its_name():
    with pytest.warns(UserWarning, match=r"classes \[Conv2d\] matched no module"):
        assert apply_activation_checkpointing(gpt(), resolve_policy(nn.Conv2d)) == []


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"classes": ["no.such.Module"]}, "not an importable nn.Module class"),
        ({"classes": [Block], "every": 0}, "'every' must be an integer >= 1"),
        ({"classes": [Block], "evry": 2}, "unknown key(s) ['evry']"),
        ({"every": 2}, "needs 'classes'"),
        ({"classes": [Block], "partition_activations": True}, "partition_activations=True is not supported"),
        ({"classes": [Block], "number_checkpoints": 4}, "use 'every'"),
        (42, "is not supported"),
    ],
)
def test_bad_policies_fail_when_the_strategy_is_built(spec, needle):
    with pytest.raises(ActivationCheckpointingError) as err:
        ZeroStrategy(stage=2, activation_checkpointing=spec)
    assert needle in str(err.value)


def test_deepspeed_switches_without_meaning_here_are_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="contiguous_memory_optimization"):
        policy = resolve_policy({"classes": [Block], "contiguous_memory_optimization": True, "cpu_checkpointing": False})
    assert policy.every == 1


def test_recomputation_with_dropout_gives_identical_gradients():
    plain = gpt()
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, resolve_policy(Block))
    x, y = batch()
    for model in (plain, checkpointed):
        torch.manual_seed(5)  # same dropout masks in both runs
        loss_of(model, x, y).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_checkpointing_keeps_only_block_inputs_and_one_blocks_activations():
    x, y = batch()
    plain = gpt()
    per_block = []
    with saved_tensor_bytes(exclude=plain.parameters()) as total:
        hooks = []
        for block in plain.blocks:
            hooks.append(block.register_forward_pre_hook(lambda m, a: per_block.append(-total["bytes"])))
            hooks.append(block.register_forward_hook(lambda m, a, o: per_block.append(per_block.pop() + total["bytes"])))
        loss_of(plain, x, y)
    without = total["bytes"]
    outside_blocks = without - sum(per_block)

    checkpointed = gpt()
    apply_activation_checkpointing(checkpointed, resolve_policy(Block))
    with saved_tensor_bytes(exclude=checkpointed.parameters()) as saved:
        loss_of(checkpointed, x, y)
    block_input = x.numel() * CONFIG.n_embd * 4  # (B, T, C) fp32 held for each recomputation
    assert saved["bytes"] <= outside_blocks + CONFIG.n_layer * block_input + max(per_block)
    assert saved["bytes"] < 0.5 * without, (saved["bytes"], without)
