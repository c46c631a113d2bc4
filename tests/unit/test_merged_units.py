"""Stage 3's fully_shard calls: adjacent layers merged within ``unit_size_mb``, their fp32 layers grouped
([Note: merged units] in engine/stage3/fsdp2.py), the planner using the same rule, and the setting checked."""

import pytest
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.config.zero_config import ZeroConfigError
from lightning_zero.engine.mixed_precision import PrecisionPolicy
from lightning_zero.engine.stage3.fsdp2_units import merged_lengths, one_dtype_units, select_units, unit_groups

POLICY = PrecisionPolicy(torch.bfloat16, torch.bfloat16)


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)  # 72 parameters, 144 bytes in bf16


def model(blocks: int = 5) -> nn.Module:
    root = nn.Module()
    root.blocks = nn.ModuleList([Block() for _ in range(blocks)])
    root.norm = nn.LayerNorm(8)
    return root


def groups(root: nn.Module, budget: float, policy: PrecisionPolicy | None = POLICY) -> list[list[str]]:
    units = select_units(root, None)
    chosen = {id(u) for u in units} | (one_dtype_units(root, units, policy.holds_fp32) if policy else set())
    units = [m for m in root.modules() if m is not root and id(m) in chosen]
    fp32 = {id(m) for m in units if policy is not None and policy.holds_fp32(m)}
    size = {
        id(m): sum(p.numel() for p in m.parameters()) * (4 if id(m) in fp32 or policy is None else 2) for m in units
    }
    names = {id(m): n for n, m in root.named_modules()}
    found = unit_groups(root, units, lambda m: size[id(m)], lambda m: id(m) in fp32, budget)
    return [[names[id(m)] for m in group] for group in found]


def test_adjacent_blocks_merge_within_the_budget_and_their_norms_form_one_fp32_unit():
    block = 16 * 4 + 72 * 2  # its norm in fp32 and its Linear in bf16: 208 bytes
    assert groups(model(), 2 * block) == [
        ["blocks.0", "blocks.1"],
        ["blocks.0.norm", "blocks.1.norm"],
        ["blocks.2", "blocks.3"],
        ["blocks.2.norm", "blocks.3.norm"],
        ["blocks.4"],
        ["blocks.4.norm"],
        ["norm"],  # the root's final norm: an fp32 layer outside every block, a unit of its own
    ]


def test_a_budget_of_zero_keeps_one_unit_per_layer_in_pre_order():
    assert groups(model(2), 0) == [["blocks.0"], ["blocks.0.norm"], ["blocks.1"], ["blocks.1.norm"], ["norm"]]


def test_a_layer_over_the_budget_stays_alone_and_fp32_runs_never_join_compute_dtype_ones():
    assert groups(model(3), 100) == [
        ["blocks.0"],
        ["blocks.0.norm"],
        ["blocks.1"],
        ["blocks.1.norm"],
        ["blocks.2"],
        ["blocks.2.norm"],
        ["norm"],
    ]
    # fp32 (no mixed policy): every layer is one dtype, and everything fits one unit.
    assert groups(model(3), 1e9, policy=None) == [["blocks.0", "blocks.1", "blocks.2"]]


def test_units_that_nest_units_that_nest_units_merge_only_their_innermost_runs():
    """T5's shape: blocks (units) hold a ModuleList of layers (units) that hold norms (fp32 units)."""
    root = nn.Module()
    root.blocks = nn.ModuleList()
    for _ in range(2):
        outer = nn.Module()
        outer.layer = nn.ModuleList([Block(), Block()])
        root.blocks.append(outer)
    assert groups(root, 1e9) == [
        ["blocks.0"],
        ["blocks.0.layer.0", "blocks.0.layer.1"],
        ["blocks.0.layer.0.norm", "blocks.0.layer.1.norm"],
        ["blocks.1"],
        ["blocks.1.layer.0", "blocks.1.layer.1"],
        ["blocks.1.layer.0.norm", "blocks.1.layer.1.norm"],
    ]


def test_merged_lengths():
    assert merged_lengths([3, 3, 3, 5, 1], 6) == [2, 1, 2]
    assert merged_lengths([7, 1], 6) == [1, 1]
    assert merged_lengths([], 6) == []


@pytest.mark.parametrize("bad", [-1, "big", True, None])
def test_unit_size_mb_is_checked(bad):
    with pytest.raises(ZeroConfigError, match="unit_size_mb"):
        ZeroStrategy(stage=3, unit_size_mb=bad)


class Routed(nn.Module):
    """A layer with a gain vector of its own whose parent calls a method of it, not its forward (Gemma-3n's AltUp
    and its ``predict``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.router = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def predict(self, x):
        return self.router(self.norm(x)) * self.scale


class CallsAMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.routed = Routed()

    def forward(self, x):
        return self.proj(self.routed.predict(x))


class InheritsTheCall(CallsAMethod):
    pass


def test_a_layer_whose_method_its_parent_calls_is_no_unit_of_its_own_though_its_layers_may_be():
    """FSDP2 gathers a unit around its forward only: as a unit, ``routed`` met its shards in ``predict``
    (``aten.mul.Tensor got mixed torch.Tensor and DTensor``, Gemma-3n under bf16-mixed at stage 3). It stays in its
    block's unit, also where the block inherits the call; its norm, called through its forward, is an fp32 unit."""
    root = nn.Module()
    root.blocks = nn.ModuleList([CallsAMethod(), InheritsTheCall()])
    assert groups(root, 0) == [["blocks.0"], ["blocks.0.routed.norm"], ["blocks.1"], ["blocks.1.routed.norm"]]


def test_a_list_of_lists_makes_units_of_the_inner_elements_not_of_the_lists():
    """Funnel Transformer's encoder holds its layers in a ``ModuleList`` of ``ModuleList``s: an inner list made a unit
    of its own was refused by ``fully_shard`` ("does not support containers that do not implement forward") once its
    layers nested units of their own (their norms, under bf16-mixed)."""
    root = nn.Module()
    root.blocks = nn.ModuleList([nn.ModuleList([Block()]), nn.ModuleList([Block(), Block()])])
    units = select_units(root, None)
    assert [name for name, m in root.named_modules() if any(m is u for u in units)] == [
        "blocks.0.0",
        "blocks.1.0",
        "blocks.1.1",
    ]
    assert groups(root, 0) == [
        ["blocks.0.0"],
        ["blocks.0.0.norm"],
        ["blocks.1.0"],
        ["blocks.1.0.norm"],
        ["blocks.1.1"],
        ["blocks.1.1.norm"],
    ]
