"""Cutting layers into pipeline stages and arranging ranks into pipelines: pure arithmetic, checked early."""

from __future__ import annotations

import itertools

import pytest
from torch import nn

from lightning_zero import ZeroConfigError
from lightning_zero.pipeline import PipelineLayout, bubble_fraction, layer_parameters, split_bounds


def linears(*widths: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(w, w, bias=False) for w in widths))


def test_even_split_gives_the_first_stages_the_extra_layers():
    assert split_bounds(linears(*[2] * 8), 2) == [0, 4, 8]
    assert split_bounds(linears(*[2] * 7), 3) == [0, 3, 5, 7]
    assert split_bounds(linears(*[2] * 4), 4) == [0, 1, 2, 3, 4]


def test_parameter_split_minimises_the_heaviest_stage():
    layers = linears(8, 1, 1, 1, 1, 8, 1, 1)  # 64, 1, 1, 1, 1, 64, 1, 1 parameters
    weights = layer_parameters(layers)
    bounds = split_bounds(layers, 3, "params")
    heaviest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    # brute force over every contiguous cut: nothing does better
    best = min(
        max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, len(weights))))
        for cuts in itertools.combinations(range(1, len(weights)), 2)
    )
    assert heaviest == best == 66
    assert all(a < b for a, b in zip(bounds, bounds[1:]))


def test_shared_parameters_count_once():
    shared = nn.Linear(4, 4)
    assert layer_parameters([shared, shared, nn.Linear(2, 2)]) == [20, 0, 6]


def test_explicit_points_by_index_or_child_name():
    model = nn.Sequential()
    for name in ("embed", "block0", "block1", "block2", "head"):
        model.add_module(name, nn.Linear(2, 2))
    assert split_bounds(model, 3, [2, 4]) == [0, 2, 4, 5]
    assert split_bounds(model, 2, ["block1"]) == [0, 2, 5]
    with pytest.raises(ZeroConfigError, match="Did you mean 'block1'"):
        split_bounds(model, 2, ["blok1"])


@pytest.mark.parametrize(
    "stages, how, message",
    [
        (6, "layers", "Cannot cut 5 layers into 6 pipeline stages"),
        (2, "flops", "`pipeline_split='flops'` is not supported; choose one of ('layers', 'params')"),
        (3, [2], "lists 1 split points for 3 stages; give 2"),
        (3, [3, 2], "strictly increasing"),
        (2, [0], "strictly increasing"),
        (2, [5], "strictly increasing"),
        (0, "layers", "`pipeline_stages` must be >= 1"),
    ],
)
def test_bad_splits_are_errors_naming_the_setting(stages, how, message):
    with pytest.raises(ZeroConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        split_bounds(linears(*[2] * 5), stages, how)


def test_layout_of_two_stages_by_two_replicas_and_interleaving():
    layout = PipelineLayout(world_size=4, ranks_per_pipeline=2)
    assert layout.replicas == 2 and layout.num_stages == 2
    assert [layout.pipeline_group(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [layout.data_parallel_group(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    interleaved = PipelineLayout(world_size=2, ranks_per_pipeline=2, virtual=2)
    assert interleaved.num_stages == 4 and interleaved.stages_of(0) == [0, 2] and interleaved.stages_of(1) == [1, 3]
    with pytest.raises(ZeroConfigError, match="3 processes cannot be divided into pipelines of 2 stages"):
        PipelineLayout(world_size=3, ranks_per_pipeline=2)


def test_a_v_runs_the_first_and_last_stage_on_rank_zero():
    """ZBV and DualPipeV: rank r of p runs stages r and 2p-1-r; the middle cut (the turn) stays on one rank."""
    v = PipelineLayout(world_size=8, ranks_per_pipeline=4, virtual=2, v_shape=True)
    assert [v.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [v.rank_of_stage(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.stages_of(5) == [1, 6] and v.data_parallel_group(5) == [1, 5]
    looped = PipelineLayout(world_size=4, ranks_per_pipeline=4, virtual=2)
    assert [looped.rank_of_stage(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ZeroConfigError, match="exactly 2 stages per rank"):
        PipelineLayout(world_size=4, ranks_per_pipeline=4, virtual=3, v_shape=True)


def test_bubble_formula():
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(2, 16) == pytest.approx(1 / 17)
    assert bubble_fraction(1, 8) == 0
