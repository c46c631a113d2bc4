"""Layers their holder runs other than through ``__call__`` (``layer.forward(x)``, as SqueezeBERT's encoder runs its
layers, or another method, as a training step calls an autoencoder's ``encode``), which skips the forward hooks
stage 3 gathers in and activation checkpointing acts in: found in the holders' source, kept from being stage-3
units, and named when checkpointing them would do nothing."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.activation_checkpointing import apply_activation_checkpointing, resolve_policy
from lightning_zero.engine.mixed_precision import PrecisionPolicy
from lightning_zero.engine.stage3.fsdp2_units import one_dtype_units, select_units
from lightning_zero.hook_bypasses import bypassing_hooks, parameters_used_by_holders


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(4), nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, h):
        return h + self.gain * self.proj(self.norm(h))


class LoopedDirectly(nn.Module):
    """SqueezeBERT's way: ``layer.forward(...)`` in a loop over the list."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.through_call = nn.ModuleList(Block() for _ in range(2))

    def forward(self, h):
        for i, layer in enumerate(self.layers):
            h = layer.forward(h)
        return sum(layer(h) for layer in self.through_call)


class IndexedAndNamed(nn.Module):
    """``self.x.forward(...)``, ``self.xs[i].forward(...)`` and a loop over a dict's items, beside a call through
    hooks (``self.head(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.stack = nn.ModuleList(Block() for _ in range(2))
        self.table = nn.ModuleDict({"a": Block()})
        self.head = Block()

    def forward(self, h):
        h = self.first.forward(h) + self.stack[1].forward(h)
        for _, layer in self.table.items():
            h = layer.forward(h)
        return self.head(h)


class Trunk(nn.Module):
    """A list two levels down, never run by its holder."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.seq = nn.Sequential(Block(), Block())


class Reached(nn.Module):
    """Layers reached through local names, ``getattr``, several levels of attributes, a literal tuple and a
    ``Sequential``'s index, beside ones only called (``self.trunk.seq[1](h)``) or only named."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = Trunk()
        self.layer_0, self.layer_1, self.other_0 = Block(), Block(), Block()
        self.a, self.b, self.c = Block(), Block(), Block()

    def forward(self, h, i: int = 0):
        layer = self.trunk.blocks[i]  # a local alias, two levels down: every element
        h = layer.forward(h)
        h = getattr(self, f"layer_{i}").forward(h)  # an f-string's constant start
        for block in (self.a, self.b):  # a literal's elements, not `c`
            h = block.forward(h)
        model = self
        h = model.trunk.seq[0].forward(h)  # `self` under another name; a Sequential's element, not the Sequential
        return self.trunk.seq[1](h) + self.c(h) + self.other_0(h)


class Dynamic(nn.Module):
    """``getattr`` with a name computed otherwise: any child may be the one run."""

    def __init__(self) -> None:
        super().__init__()
        self.x, self.y = Block(), nn.ModuleList([Block()])

    def forward(self, h, name: str):
        return getattr(self, name).forward(h)


class ChannelsFirstNorm(nn.LayerNorm):
    """SqueezeBERT's LayerNorm: a base class's forward run on ``self``, no layer's."""

    def forward(self, x):
        return nn.LayerNorm.forward(self, x.transpose(1, 2)).transpose(1, 2)


class Extended(Block):
    def forward(self, h):
        return super().forward(h) + self.norm(h)


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(4, 2), nn.Linear(2, 4)

    def encode(self, x):
        return self.enc(x)

    def decode(self, z):
        return self.dec(z)


class Generator(nn.Module):
    """Methods that run the module through its ``__call__`` (as Hugging Face's ``generate``) or touch none of its
    layers leave it a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)

    def generate(self, x, steps: int):
        for _ in range(steps):
            x = self(x)
        return x

    def describe(self):
        return type(self).__name__


class Sampling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = Generator()

    def training_step(self, x):
        label = self.gen.describe()
        return self.gen.generate(x, 2).sum(), label


class Reconstruction(nn.Module):
    """A training step's way with an autoencoder: its methods, never its forward; no list of blocks anywhere, so by
    default each child holding parameters would be a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.vae, self.head = AutoEncoder(), nn.Linear(2, 1)

    def training_step(self, x):
        z = self.vae.encode(x)
        return (self.vae.decode(z) - x).square().mean() + self.head(z).mean()


class TiedHead(nn.Module):
    """A head computing with the embedding's weight; reads that compute nothing (its dtype, its shape, a grouping of
    parameters in ``configure_optimizers``) and set-up code (tying in ``__init__``) leave a layer alone."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.norm, self.proj = (
            nn.Embedding(8, 4),
            nn.Linear(4, 4),
            nn.LayerNorm(4),
            nn.Linear(4, 4),
        )
        self.proj.bias = nn.Parameter(torch.zeros(4))  # set-up code naming a layer's parameter

    def forward(self, tokens):
        h = self.mix(self.embed(tokens)).to(self.norm.weight.dtype) * self.proj.weight.shape[0]
        assert self.proj.weight.size(0) == 4 and self.proj.weight.requires_grad
        return F.linear(self.norm(h), self.embed.weight)

    def configure_optimizers(self):
        return torch.optim.AdamW([{"params": [self.mix.weight]}, {"params": [self.proj.weight], "lr": 0.0}])


def names(module, ids):
    return sorted(n for n, m in module.named_modules() if id(m) in ids)


def test_the_layers_a_holder_runs_through_forward_are_found_by_name():
    looped = LoopedDirectly()
    assert sorted(bypassing_hooks(looped).values()) == ["layers.0", "layers.1"]
    other = IndexedAndNamed()
    # `self.stack[1].forward`: the element a constant index names
    assert sorted(bypassing_hooks(other).values()) == ["first", "stack.1", "table.a"]
    # torch's own classes call through hooks; a base class's forward on `self` and `super().forward` are no layer's
    assert bypassing_hooks(nn.Sequential(Block(), nn.LayerNorm(4), ChannelsFirstNorm(4), Extended())) == {}


def test_layers_reached_through_names_getattr_and_nested_attributes_are_found():
    found = bypassing_hooks(Reached())
    assert sorted(found.values()) == ["a", "b", "layer_0", "layer_1", "trunk.blocks.0", "trunk.blocks.1", "trunk.seq.0"]
    assert sorted(bypassing_hooks(Dynamic()).values()) == ["x", "y.0"]
    model = Reached()
    units = names(model, {id(u) for u in select_units(model, Block)})
    assert "trunk.seq.1" in units and "c" in units and "other_0" in units  # run through `__call__`: units
    assert not {"a", "layer_0", "trunk.blocks.0", "trunk.seq.0"} & set(units)  # run through `.forward`: their layers
    assert {"a.norm", "a.proj", "trunk.blocks.0.norm", "trunk.seq.0.proj"} <= set(units)


def test_layers_whose_parameters_their_holder_computes_with_are_found_and_never_units():
    model = TiedHead()
    assert list(parameters_used_by_holders(model).values()) == ["embed"]
    assert names(model, {id(u) for u in select_units(model, None)}) == ["mix", "norm", "proj"]
    # torch's MultiheadAttention hands `out_proj.weight` to the functional attention: never a unit of its own
    blocks = nn.ModuleList(nn.TransformerEncoderLayer(4, 2, 8, batch_first=True) for _ in range(2))
    assert sorted(parameters_used_by_holders(blocks).values()) == ["0.self_attn.out_proj", "1.self_attn.out_proj"]
    units = names(blocks, {id(u) for u in select_units(blocks, nn.Linear)})
    assert units == ["0.linear1", "0.linear2", "1.linear1", "1.linear2"]


def test_a_block_run_through_forward_gives_its_layers_as_stage_3_units():
    model = LoopedDirectly()
    # by default (each list element) and under a policy naming the block class: the blocks' layers, not the blocks;
    # the blocks called through `__call__` stay units
    expected = ["layers.0.norm", "layers.0.proj", "layers.1.norm", "layers.1.proj", "through_call.0", "through_call.1"]
    assert names(model, {id(u) for u in select_units(model, None)}) == expected
    assert names(model, {id(u) for u in select_units(model, Block)}) == expected
    units = select_units(model, None)
    assert [id(u) for u in units] == [id(m) for m in model.modules() if id(m) in {id(u) for u in units}]  # pre-order


def test_a_module_whose_methods_its_holder_calls_gives_its_layers_as_units():
    model = Reconstruction()
    assert list(bypassing_hooks(model).values()) == ["vae"]
    assert names(model, {id(u) for u in select_units(model, None)}) == ["head", "vae.dec", "vae.enc"]


def test_methods_that_run_the_module_through_its_call_or_touch_none_of_it_leave_it_a_unit():
    model = Sampling()
    assert bypassing_hooks(model) == {}
    assert names(model, {id(u) for u in select_units(model, None)}) == ["gen"]


def test_a_layer_run_through_forward_is_no_extra_unit_of_its_own_dtype():
    """Under a mixed policy a LayerNorm inside a unit becomes an fp32 unit of its own; one its block calls as
    ``self.norm.forward(h)`` stays in the block's unit, computed in the block's dtype."""

    class DirectNorm(Block):
        def forward(self, h):
            return h + self.proj(self.norm.forward(h))

    policy = PrecisionPolicy(torch.bfloat16, torch.bfloat16)
    plain, direct = nn.ModuleList([nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))]), nn.ModuleList([DirectNorm()])
    assert names(plain, one_dtype_units(plain, select_units(plain, None), policy.holds_fp32)) == ["0.0"]
    direct[0].gain = None  # the norm alone holds fp32 parameters in the block
    assert names(direct, one_dtype_units(direct, select_units(direct, None), policy.holds_fp32)) == []


def test_checkpointing_a_layer_run_through_forward_warns_with_what_to_checkpoint_instead():
    model = LoopedDirectly()
    expected = (
        r"the code holding 'layers.0', 'layers.1' runs it other than through its `__call__` .* what runs so keeps "
        r"its activations\. Checkpoint the layers they call instead \(LayerNorm, Linear\)"
    )
    with pytest.warns(UserWarning, match=expected):
        apply_activation_checkpointing(model, resolve_policy(Block))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        apply_activation_checkpointing(LoopedDirectly(), resolve_policy(nn.Linear))  # called through hooks
    assert not [w for w in record if "other than through" in str(w.message)]
