"""Which optimizers step whole parameters, and how whole parameters get their owners (``engine/owner_step.py``)."""

import math

import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.engine.optimizers import optimizer_kind, steps_whole
from lightning_zero.engine.owner_step import OwnerStepping, plan_owners


def _params(*shapes):
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]


class MyMuon(torch.optim.SGD):
    """A user's whole-matrix optimizer (its maths do not matter here)."""


class Shampoo(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


@pytest.mark.parametrize(
    ("build", "declared", "kind"),
    [
        (lambda p: torch.optim.Muon(p), (), "matrix"),
        (lambda p: torch.optim.Adafactor(p), (), "matrix"),
        (lambda p: type("SubMuon", (torch.optim.Muon,), {})(p), (), "matrix"),  # subclasses count
        (lambda p: torch.optim.AdamW(p), (), "elementwise"),
        (lambda p: MyMuon(p, lr=0.1), (MyMuon,), "matrix"),  # declared beats being an SGD subclass
        (lambda p: Shampoo(p), (Shampoo,), "matrix"),
    ],
)
def test_optimizer_kind(build, declared, kind):
    assert optimizer_kind(build(_params((4, 3))), stage=2, matrix=declared) == kind


def test_an_unknown_optimizer_is_refused_with_the_ways_to_declare_it():
    with pytest.raises(TypeError) as err:
        optimizer_kind(Shampoo(_params((4, 3))), stage=3)
    assert "elementwise_optimizers=(Shampoo,)" in str(err.value)
    assert "matrix_optimizers=(Shampoo,)" in str(err.value) and "Muon" in str(err.value)


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (lambda p: torch.optim.LBFGS(p), "dot products over every parameter"),
        (lambda p: torch.optim.SparseAdam(p), "sparse gradients only"),
    ],
)
def test_optimizers_no_declaration_could_shard_are_refused_with_the_reason_not_a_declaration(build, why):
    """Neither declaration would be exact for them (LBFGS couples every parameter; SparseAdam cannot take the dense
    gradients ZeroStrategy makes), so the error says why and points to ``ddp``, not to a declaration."""
    optimizer = build(_params((4, 3)))
    with pytest.raises(TypeError) as err:
        optimizer_kind(optimizer, stage=2)
    assert why in str(err.value) and "`ddp`" in str(err.value)
    assert "elementwise_optimizers" not in str(err.value)


def test_groups_marked_elementwise_step_on_shards():
    assert steps_whole({"params": [], "use_muon": True}, "matrix")
    assert steps_whole({"params": []}, "matrix")
    assert not steps_whole({"params": [], "use_muon": False}, "matrix")
    assert not steps_whole({"params": [], "elementwise": True}, "matrix")
    assert not steps_whole({"params": [], "use_muon": True}, "elementwise")


def test_owners_balance_elements_and_every_rank_plans_the_same():
    shapes = {
        0: torch.Size((64, 64)),
        1: torch.Size((64, 16)),
        2: torch.Size((64, 16)),
        3: torch.Size((16, 64)),
        4: torch.Size((64, 64)),
        5: torch.Size((8,)),
    }
    plan = plan_owners(shapes, 2)
    assert plan == plan_owners(dict(reversed(list(shapes.items()))), 2)  # order-independent, deterministic
    load = [sum(math.prod(shapes[k]) for k, r in plan.items() if r == rank) for rank in range(2)]
    assert sorted(load) == [5128, 6144]  # the two big matrices apart: the best split of these sizes
    assert plan[0] != plan[4]


def test_adopt_keeps_earlier_owners_and_reports_the_imbalance():
    stepping = OwnerStepping(rank=0, world_size=3, comm_device=torch.device("cpu"))
    stepping.adopt({0: torch.Size((10, 10)), 1: torch.Size((5, 10))}, lambda k: torch.zeros(1))
    first = dict(stepping.owner)
    stepping.adopt({0: torch.Size((10, 10)), 1: torch.Size((5, 10)), 2: torch.Size((5, 10))}, lambda k: torch.zeros(1))
    assert {k: stepping.owner[k] for k in first} == first
    assert stepping.owner[2] == 2  # the rank that owned nothing yet
    assert stepping.imbalance() == pytest.approx(100 / (200 / 3))
    assert set(stepping.whole) == {k for k, r in stepping.owner.items() if r == 0}


def test_one_rank_round_trip_gives_the_owner_the_whole_gradient_and_writes_rows_back():
    """World size 1 (no process group): the all-to-alls are copies; gradients and rows land whole and back."""
    truth = {0: torch.randn(5, 3), 1: torch.randn(4)}
    grads = {0: torch.randn(5, 3), 1: None}
    stepping = OwnerStepping(rank=0, world_size=1, comm_device=torch.device("cpu"))
    stepping.adopt({k: t.shape for k, t in truth.items()}, lambda k: torch.zeros(truth[k].shape))
    stepping.gather([0, 1], truth.__getitem__, grads.__getitem__)
    assert torch.equal(stepping.whole[0], truth[0]) and torch.equal(stepping.whole[1], truth[1])
    assert torch.equal(stepping.grads[0], grads[0]) and 1 not in stepping.grads  # no gradient: not stepped
    stepping.whole[0].add_(1.0)
    written = {}
    stepping.scatter([0, 1], lambda k, rows: written.__setitem__(k, rows.clone()))
    assert torch.equal(written[0].view(5, 3), truth[0] + 1.0) and torch.equal(written[1], truth[1])
    assert stepping.grads == {}


def test_matrix_optimizers_setting_is_validated():
    assert ZeroStrategy(stage=2, matrix_optimizers=[MyMuon]).zero_config.matrix_optimizers == (MyMuon,)
    with pytest.raises(ZeroConfigError, match="matrix_optimizers"):
        ZeroStrategy(stage=2, matrix_optimizers=("torch.optim.Muon",))
