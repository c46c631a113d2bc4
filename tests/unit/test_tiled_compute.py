"""Tiled compute (one process): ``tiled_forward`` and ``tiled_cross_entropy`` give the untiled values and gradients
while only a tile's intermediate exists, and ``tiled_compute`` wraps a Hugging Face causal LM, leaving what it cannot
tile whole (the Trainer runs are in ``tests/distributed/test_long_context.py``)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroConfigError, ZeroStrategy, tiled_cross_entropy, tiled_forward
from lightning_zero.planning.measure import _TotalsOnly
from lightning_zero.tiled_compute import apply_tiled_compute
from tests.distributed import hf_models

T, D, VOCAB, TILE = 64, 16, 512, 8


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))


def peak_bytes(step) -> int:
    """The most tensor bytes alive while ``step`` runs (the planner's tracker), beyond what existed before."""
    tracker = _TotalsOnly()
    with tracker:
        step()
    return sum(per_device.get("Total", 0) for per_device in tracker.get_tracker_snapshot("peak").values())


def test_tiled_forward_gives_the_untiled_values_and_gradients():
    whole, tiled = mlp(), mlp()
    x = torch.randn(2, T, D, requires_grad=True)
    x_tiled = x.detach().clone().requires_grad_()
    expected = whole(x)
    got = tiled_forward(tiled, x_tiled, tile_size=TILE)
    torch.testing.assert_close(got, expected)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x_tiled.grad, x.grad)
    for a, b in zip(whole.parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


def test_a_per_position_argument_is_split_with_the_hidden_states():
    """Bloom's MLP takes the residual beside the hidden states: it is tiled with them."""
    torch.manual_seed(0)
    model = mlp()
    x, residual = torch.randn(2, T, D), torch.randn(2, T, D)
    scale = torch.randn(D)  # not per position: whole to every tile
    expected = model(x) + residual * scale
    got = tiled_forward(lambda h, r, s: model(h) + r * s, x, residual, scale, tile_size=TILE)
    torch.testing.assert_close(got, expected)


def test_tiled_forward_holds_one_tile_of_the_intermediate():
    """Untiled, forward keeps the ``[T, 4d]`` intermediate (twice: the first linear's output and GELU's) for
    backward; tiled, only the tiles' inputs (views of the input) and one tile's intermediate at a time."""
    model = mlp()
    x = torch.randn(1, T, D, requires_grad=True)
    intermediate = T * 4 * D * 4  # bytes of one [T, 4d] fp32 tensor
    whole = peak_bytes(lambda: model(x).sum().backward())
    tiles = peak_bytes(lambda: tiled_forward(model, x, tile_size=TILE).sum().backward())
    assert whole - tiles >= 2 * intermediate * (1 - 2 * TILE / T), (whole, tiles)


def loss_inputs(ignore: bool = True):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, T, D, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, D, generator=g, requires_grad=True)
    bias = torch.randn(VOCAB, generator=g, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, T), generator=g)
    if ignore:
        labels[0, :5] = -100
        labels[1, -1] = -100
    return hidden, weight, bias, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_cross_entropy_gives_the_untiled_loss_and_gradients(reduction):
    hidden, weight, bias, labels = loss_inputs()
    expected = F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, 1), labels.flatten(), reduction=reduction)
    expected.backward()
    wanted = [t.grad for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    got = tiled_cross_entropy(hidden, weight, labels, bias, tile_size=TILE, reduction=reduction)
    torch.testing.assert_close(got, expected)
    got.backward()
    for t, want in zip((hidden, weight, bias), wanted):
        torch.testing.assert_close(t.grad, want)


def test_tiled_cross_entropy_holds_one_tile_of_logits():
    """Untiled, the ``[B*T, vocab]`` logits and the loss's softmax of them live through forward and backward; tiled,
    one tile's."""
    hidden, weight, _, labels = loss_inputs()
    logits = hidden.shape[0] * T * VOCAB * 4
    whole = peak_bytes(lambda: F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten()).backward())
    tiles = peak_bytes(lambda: tiled_cross_entropy(hidden, weight, labels, tile_size=TILE).backward())
    assert whole - tiles >= 2 * logits * (1 - 2 * TILE / (2 * T)), (whole, tiles)


def test_bad_arguments_say_what_is_allowed():
    hidden, weight, _, labels = loss_inputs()
    with pytest.raises(ValueError, match="tile_size must be a positive number"):
        tiled_cross_entropy(hidden, weight, labels, tile_size=0)
    with pytest.raises(ValueError, match="must match hidden"):
        tiled_cross_entropy(hidden, weight, labels[:, 1:])
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        tiled_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(TypeError, match="not one tensor"):
        tiled_forward(lambda t: (t, t), hidden, tile_size=TILE)
    for value in (0, "yes", 2.5):
        with pytest.raises(ZeroConfigError, match="`tiled_compute` must be True, False or a positive number"):
            ZeroStrategy(tiled_compute=value)


def llama(**config):
    torch.manual_seed(0)
    settings = hf_models.tiny_config("llama")
    for key, value in config.items():
        setattr(settings, key, value)
    return hf_models.model_class("llama")(settings)


def test_a_causal_lm_trains_without_logits_and_evaluates_with_them():
    whole = llama()
    tiled = copy.deepcopy(whole)
    undo = apply_tiled_compute(tiled, 5)
    ids = torch.randint(0, hf_models.VOCAB, (2, hf_models.LENGTH), generator=torch.Generator().manual_seed(0))
    expected, got = whole(input_ids=ids, labels=ids), tiled(input_ids=ids, labels=ids)
    assert got.logits is None and "logits" not in got and list(got.keys())[0] == "loss"
    torch.testing.assert_close(got.loss, expected.loss)
    torch.testing.assert_close(got[0], expected.loss)  # `model(**batch)[0]`, as scripts index it
    with torch.no_grad():
        evaluated = tiled(input_ids=ids, labels=ids)
    torch.testing.assert_close(evaluated.logits, expected.logits)  # without grad the model runs as written
    undo()
    assert not any("forward" in m.__dict__ for m in tiled.modules())


def test_a_mixture_of_experts_keeps_its_load_balancing_loss():
    """Mixtral with ``output_router_logits``: the model adds its routers' auxiliary loss to the loss given labels;
    tiled, the loss is computed without them, and the auxiliary term is added back."""
    torch.manual_seed(0)
    settings = hf_models.tiny_config("mixtral")
    settings.output_router_logits = True
    whole = hf_models.model_class("mixtral")(settings)
    tiled = copy.deepcopy(whole)
    apply_tiled_compute(tiled, 5)
    ids = torch.randint(0, hf_models.VOCAB, (2, hf_models.LENGTH), generator=torch.Generator().manual_seed(0))
    expected, got = whole(input_ids=ids, labels=ids), tiled(input_ids=ids, labels=ids)
    assert expected.aux_loss > 0
    torch.testing.assert_close(got.loss, expected.loss)
    as_tuple = tiled(input_ids=ids, labels=ids, return_dict=False)  # a tuple has no loss to set: run as written
    torch.testing.assert_close(as_tuple[0], expected.loss)


@pytest.mark.parametrize("kind", ["gemma2", "bart"])
def test_a_head_whose_loss_is_not_the_shifted_one_stays_whole_and_its_mlps_are_tiled(kind):
    """Gemma-2 caps its logits after lm_head; BART's causal LM takes its labels unshifted: their heads stay whole
    (the loss as the model computes it), their MLPs are tiled where they are held as ``mlp``."""
    import transformers

    torch.manual_seed(0)
    if kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=16,
            )
        )
    else:
        model = transformers.BartForCausalLM(
            transformers.BartConfig(
                vocab_size=64,
                d_model=32,
                decoder_layers=2,
                decoder_attention_heads=4,
                decoder_ffn_dim=64,
                max_position_embeddings=16,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
            )
        )
    whole = copy.deepcopy(model)
    apply_tiled_compute(model, 5)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    if kind == "gemma2":  # BART's layers hold fc1/fc2, no `mlp`
        assert all("forward" in layer.mlp.__dict__ for layer in model.model.layers)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, whole(input_ids=ids, labels=ids).loss)


def test_a_module_without_a_causal_lm_is_told_of_the_helpers():
    with pytest.warns(UserWarning, match="lightning_zero.tiled_forward"):
        apply_tiled_compute(mlp(), None)
