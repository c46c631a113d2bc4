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
    [
        Block,
        {Block},
        [Block],
        "lightning_zero.demo.gpt.Block",
        lambda m: isinstance(m, Block),
        {"classes": ["lightning_zero.demo.gpt.Block"]},
        {"classes": Block, "every": 1},
    ],
)
def test_every_policy_form_selects_the_blocks(spec):
    names = apply_activation_checkpointing(gpt(), resolve_policy(spec))
    assert names == [f"blocks.{i}" for i in range(CONFIG.n_layer)]


def test_every_k_and_nested_matches():
    model = gpt()
    assert apply_activation_checkpointing(model, resolve_policy({"classes": [Block], "every": 2})) == [
        "blocks.0",
        "blocks.2",
    ]
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
        policy = resolve_policy(
            {"classes": [Block], "contiguous_memory_optimization": True, "cpu_checkpointing": False}
        )
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


class Scaled(nn.Linear):
    """A layer whose forward pre-hook rewrites its input, as a user's or a library's pre-hook may."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_forward_pre_hook(lambda module, args: (args[0] * 2.0,))


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_layers_whose_forward_pre_hooks_compute_recompute_those_hooks_as_they_ran():
    """The hook-based ``weight_norm`` computes the weight in a forward pre-hook and pruning multiplies it by its mask
    there; the recomputation runs the module's hooks again, so the checkpoint must begin before them, else the
    recomputed tensors do not match the saved ones (``CheckpointError``) and a hook that rewrites the input is
    applied twice."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.utils.weight_norm(nn.Conv1d(8, 8, 3, padding=1)), nn.Linear(4, 4), Scaled())
        torch.nn.utils.prune.l1_unstructured(model[1], "bias", amount=0.5)
        return model

    plain, checkpointed = build(), build()
    assert apply_activation_checkpointing(checkpointed, resolve_policy([nn.Conv1d, nn.Linear])) == ["0", "1", "2"]
    x = torch.randn(2, 8, 4)
    for model in (plain, checkpointed):
        model(x).square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


class RunningAverage(nn.Module):
    """A layer of the user's own that keeps a running average of its input in a buffer, updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("average", torch.zeros(4))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.average.mul_(0.9).add_(x.mean((0, 1)), alpha=0.1)
        return self.linear(x) + self.average


class NormalizedBlock(nn.Module):
    """Every kind of buffer a forward updates: BatchNorm (momentum and cumulative), InstanceNorm with running
    statistics, spectral norm as a hook and as a parametrization (a power iteration each forward), a running average."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.bn, self.cumulative = nn.BatchNorm1d(4), nn.BatchNorm1d(4, momentum=None)
        self.instance = nn.InstanceNorm1d(4, track_running_stats=True)
        self.hooked = nn.utils.spectral_norm(nn.Linear(5, 5))
        self.parametrized = nn.utils.parametrizations.spectral_norm(nn.Linear(5, 5))
        self.average = RunningAverage()

    def forward(self, x):  # (B, 4, 5)
        h = self.parametrized(self.hooked(self.instance(self.cumulative(self.bn(self.conv(x))))))
        return self.average(h.transpose(1, 2)).transpose(1, 2)


def _plain_and_checkpointed(build):
    torch.manual_seed(0)
    plain = build()
    checkpointed = copy.deepcopy(plain)
    assert apply_activation_checkpointing(checkpointed, resolve_policy(NormalizedBlock))
    return plain, checkpointed


def _assert_same_state(plain, checkpointed, atol=0.0):
    for (name, a), (_, b) in zip(plain.named_buffers(), checkpointed.named_buffers()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("shape", ["two_blocks", "one_block_run_three_times"])
def test_buffers_a_forward_updates_are_updated_once_and_recomputed_as_they_were(shape):
    """torch's checkpoint runs a forward again in backward, so BatchNorm counted each batch twice and its running
    statistics drifted, and spectral norm's recomputed weight was one power iteration further on (gradients 4.5e-2
    apart at the first step): against the same model without checkpointing, every buffer and gradient is equal after
    each step, also for a block run three times a forward."""

    def build():
        if shape == "two_blocks":
            return nn.Sequential(NormalizedBlock(), NormalizedBlock())
        block = NormalizedBlock()
        return nn.Sequential(block, block, block)

    plain, checkpointed = _plain_and_checkpointed(build)
    for step in range(3):
        x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(step))
        for model in (plain, checkpointed):
            model.zero_grad()
            model(x).square().sum().backward()
        _assert_same_state(plain, checkpointed, atol=0.0 if shape == "two_blocks" else 1e-6)


def test_a_graph_differentiated_twice_recomputes_from_the_same_buffers_twice():
    """A gradient penalty recomputes each block twice (``create_graph=True``, then the loss's backward): both
    recomputations start from the buffers the forward found, and leave them as the forward did."""
    plain, checkpointed = _plain_and_checkpointed(lambda: nn.Sequential(NormalizedBlock(), NormalizedBlock()))
    for model in (plain, checkpointed):
        x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(9), requires_grad=True)
        out = model(x).square().sum()
        (grad,) = torch.autograd.grad(out, x, create_graph=True)
        (out + grad.square().sum()).backward()
    _assert_same_state(plain, checkpointed, atol=1e-6)


def test_checkpointing_keeps_only_block_inputs_and_one_blocks_activations():
    x, y = batch()
    plain = gpt()
    per_block = []
    with saved_tensor_bytes(exclude=plain.parameters()) as total:
        hooks = []
        for block in plain.blocks:
            hooks.append(block.register_forward_pre_hook(lambda m, a: per_block.append(-total["bytes"])))
            hooks.append(
                block.register_forward_hook(lambda m, a, o: per_block.append(per_block.pop() + total["bytes"]))
            )
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


def test_hugging_face_encoder_decoder_trains_checkpointed_with_its_cache_off_then_gets_it_back(caplog):
    """T5 keeps ``use_cache=True`` in its decoder stack's own copy of the config: checkpointing its blocks raised
    ``CheckpointError`` (a different number of tensors saved in the recomputation) until the cache was turned off
    for training, as Hugging Face's ``gradient_checkpointing_enable()`` does."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Block

    from lightning_zero.activation_checkpointing import caches_off_for_training

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0
    )
    model = transformers.T5ForConditionalGeneration(config)
    plain = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 12))
    names = apply_activation_checkpointing(model, resolve_policy(T5Block))
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        model(input_ids=x, decoder_input_ids=x).logits.sum().backward()
    model.zero_grad()
    with caplog.at_level("INFO"):
        restore = caches_off_for_training(model, names)
    assert [r.getMessage() for r in caplog.records if "use_cache" in r.getMessage()] == [
        "activation_checkpointing: training T5ForConditionalGeneration with use_cache=False, as Hugging Face's "
        "gradient_checkpointing_enable() does (a cache written in forward cannot be recomputed)."
    ]
    model(input_ids=x, decoder_input_ids=x).logits.sum().backward()
    # Against the plain model trained as Hugging Face trains it checkpointed, without the cache: with it, transformers
    # 5.x takes another attention path whose sums round differently (1e-5 on gradients of magnitude 65).
    plain(input_ids=x, decoder_input_ids=x, use_cache=False).logits.sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
    restore()
    assert model.config.use_cache and model.decoder.config.use_cache and not model.encoder.config.use_cache


def test_models_without_a_checkpointed_module_keep_their_cache():
    transformers = pytest.importorskip("transformers")
    from lightning_zero.activation_checkpointing import caches_off_for_training

    model = nn.ModuleDict(
        {"lm": transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2)), "other": gpt()}
    )
    names = apply_activation_checkpointing(model, resolve_policy(Block))
    caches_off_for_training(model, names)
    assert model["lm"].config.use_cache
