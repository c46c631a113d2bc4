"""Hybrid sharding and hpZ without processes: settings and their errors (before any process group exists), the
DeepSpeed keys, the rank arithmetic, and how traffic is split into intra- and inter-node groups."""

import os
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, ZeroConfigError, ZeroStrategy
from lightning_zero.cli.command_line import CommandLine
from lightning_zero.cli.compose import compose
from lightning_zero.cli.schema import LightningSchema
from lightning_zero.engine.comm.comm_stats import CommStats
from lightning_zero.engine.comm.topology import Topology


def _trainer(strategy, devices=4, num_nodes=1):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, num_nodes=num_nodes, logger=False)


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(shard_size=0), ["shard_size", "'node'", "0"]),
        (dict(shard_size="rack"), ["shard_size", "'node'"]),
        (dict(shard_size=True), ["shard_size"]),
        (dict(secondary_shard_size=2), ["secondary_shard_size", "stage=3"]),
        (
            dict(stage=3, shard_size=2, secondary_shard_size=2),
            ["secondary_shard_size", "shard_size", "cannot be combined"],
        ),
        (dict(shard_size=2, pipeline_stages=2), ["shard_size", "pipeline_stages"]),
    ],
)
def test_bad_settings_fail_when_the_strategy_is_built(kwargs, needles):
    with pytest.raises(ZeroConfigError) as err:
        ZeroStrategy(**kwargs)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(
    "kwargs, devices, needles",
    [
        (dict(shard_size=3), 4, ["shard_size=3", "does not divide", "world size 4", "[2, 4]"]),
        (dict(shard_size=8), 4, ["shard_size=8", "larger than", "world size 4"]),
        (dict(shard_size=1), 4, ["shard_size", "1 rank", "ddp"]),
        (dict(stage=3, secondary_shard_size=3), 4, ["secondary_shard_size=3", "does not divide"]),
    ],
)
def test_sizes_that_do_not_fit_the_cluster_fail_before_any_process_group(kwargs, devices, needles):
    with pytest.raises(ZeroConfigError) as err:
        _trainer(ZeroStrategy(**kwargs), devices=devices)
    for needle in needles:
        assert needle in str(err.value)
    assert not (dist.is_available() and dist.is_initialized())


def test_node_groups_on_an_uneven_torchrun_cluster_are_refused():
    """torchrun started 3 ranks for 2 nodes of 2 devices: a node cannot be a shard group."""
    env = dict(
        TORCHELASTIC_RUN_ID="x",
        GROUP_RANK="0",
        LOCAL_WORLD_SIZE="2",
        LOCAL_RANK="0",
        WORLD_SIZE="3",
        RANK="0",
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29555",
    )
    with mock.patch.dict(os.environ, env), pytest.raises(ZeroConfigError, match="uneven cluster"):
        _trainer(ZeroStrategy(shard_size="node"), devices=2, num_nodes=2)


def test_fitting_sizes_are_accepted_and_typed():
    assert _trainer(ZeroStrategy(shard_size="node"), devices=2, num_nodes=2).strategy.zero_config.shard_size == "node"
    assert ZeroStrategy(shard_size="2").zero_config.shard_size == 2  # from a command line
    assert ZeroStrategy(stage=3, secondary_shard_size="node").zero_config.group_sizes(8, 4) == (8, 4)
    assert ZeroStrategy(shard_size="node").zero_config.group_sizes(8, 4) == (4, None)
    assert ZeroStrategy().zero_config.group_sizes(8, 4) == (8, None)


def test_deepspeed_keys_map_onto_the_arguments():
    mics = ZeroStrategy(
        config={"zero_optimization": {"stage": 2, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}}
    )
    assert (mics.zero_config.stage, mics.zero_config.shard_size) == (2, 2)
    hpz = ZeroStrategy(config={"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})
    assert hpz.zero_config.secondary_shard_size == 4
    off = ZeroStrategy(config={"zero_optimization": {"stage": 3, "mics_shard_size": -1, "zero_hpz_partition_size": 1}})
    assert (off.zero_config.shard_size, off.zero_config.secondary_shard_size) == (None, None)


@pytest.mark.parametrize(
    "zero, needle",
    [
        ({"mics_shard_size": 0}, "mics_shard_size"),
        ({"mics_shard_size": "two"}, "mics_shard_size"),
        ({"mics_hierarchical_params_gather": True}, "needs `mics_shard_size`"),
        ({"zero_hpz_partition_size": 0}, "zero_hpz_partition_size"),
        ({"stage": 2, "zero_hpz_partition_size": 2}, "stage=3"),
    ],
)
def test_bad_deepspeed_keys_name_the_key(zero, needle):
    with pytest.raises(ZeroConfigError, match=needle.replace("`", ".")):
        ZeroStrategy(config={"zero_optimization": zero})


def test_yaml_override_reaches_the_strategy():
    line = CommandLine.parse(["fit", "--config", "conf/gpt_zero3.yaml", "strategy.shard_size=node"])
    config = compose(line, LightningSchema("fit"))
    assert config["trainer"]["strategy"]["init_args"] == {"stage": 3, "shard_size": "node"}


def test_topology_arithmetic():
    topology = Topology(world_size=8, node_size=4, shard_size=4)
    assert topology.replicas == 2 and topology.hybrid
    assert topology.shard_ranks(5) == (4, 5, 6, 7)
    assert topology.replica_ranks(5) == (1, 5)
    assert not topology.spans_nodes(topology.shard_ranks(5)) and topology.spans_nodes(topology.replica_ranks(5))
    assert not Topology(world_size=8, node_size=4, shard_size=8).hybrid
    with pytest.raises(ValueError, match="shard_size=3"):
        Topology(world_size=8, node_size=4, shard_size=3)


def test_traffic_is_split_by_group_and_node():
    stats = CommStats()
    stats.record("reduce_scatter", torch.empty(10), (0, 1))
    stats.record("all_reduce", torch.empty(5), (0, 2), times=2)
    snapshot = stats.snapshot()
    assert (snapshot["elements_intra_node"], snapshot["elements_inter_node"]) == (20, 0)  # one node until told
    stats.set_node_size(2)
    snapshot = stats.snapshot()
    assert (snapshot["elements_intra_node"], snapshot["elements_inter_node"]) == (10, 10)
    assert snapshot["bytes_inter_node"] == 40 and snapshot["elements_by_kind"] == {
        "reduce_scatter": 10,
        "all_reduce": 10,
    }
    assert snapshot["by_group"]["0,2"] == {
        "inter_node": True,
        "calls": {"all_reduce": 1},
        "elements_by_kind": {"all_reduce": 10},
        "bytes_by_kind": {"all_reduce": 40},
    }


def test_estimate_knows_hybrid_sharding_and_hpz():
    from lightning_zero.planning.formulas import CHOICES_BY_NAME, estimate, model_state_split

    p = 1e9
    by_name = {e.choice.name: e for e in estimate(p, devices=8, nodes=4)}
    assert by_name["zero2_hsdp"].device_bytes == pytest.approx(4 * p + 12 * p / 8)  # N -> k = 8, not 32
    assert by_name["zero3_hsdp"].device_bytes == pytest.approx(16 * p / 8)
    assert by_name["zero3_hpz"].device_bytes == pytest.approx(16 * p / 32 + 4 * p / 8)  # plus the node-local copy
    assert [by_name[n].inter_node_elements for n in ("zero2_hsdp", "zero2", "zero3_hsdp", "zero3_hpz", "zero3")] == [
        pytest.approx(2 / 8),
        2.0,
        pytest.approx(2 / 8),
        2.0,
        3.0,
    ]
    assert "zero2_hsdp" not in {e.choice.name for e in estimate(p, devices=8, nodes=1)}  # on one node: the flat rows
    assert model_state_split(CHOICES_BY_NAME["zero3_hpz"], p, 32, "bf16-mixed", 8)[0] == pytest.approx(
        16 * p / 32 + 2 * p / 8
    )
    assert CHOICES_BY_NAME["zero2_hsdp"].strategy() == {
        "class_path": "lightning_zero.ZeroStrategy",
        "init_args": {"stage": 2, "shard_size": "node"},
    }


def test_hpz_moves_the_roots_other_parameters_into_units_of_their_own():
    """See [Note: hpZ and the root]: each direct child holding parameters outside the wrap units becomes a unit,
    unless it shares a parameter with another child or the root (FSDP2 cannot split a parameter across units)."""
    from torch import nn

    from lightning_zero.engine.stage3.fsdp2_units import select_units, units_below_the_root

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied across two children: both stay in the root
            self.norm = nn.LayerNorm(4)
            self.empty = nn.ReLU()
            self.model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)]))  # encloses a unit

    root = Root()
    units = select_units(root, None)
    assert units == [*root.blocks, root.model[1][0]]
    assert units_below_the_root(root, units) == [root.norm, root.model]
    root.scale = nn.Parameter(torch.ones(4))
    root.norm.weight = root.scale  # shared with the root itself
    assert units_below_the_root(root, units) == [root.model]


def test_the_watchdog_compares_step_marks_with_a_rank_that_issues_the_same_collectives():
    """Under hybrid sharding the ranks of one shard group all-reduce different rows (of different sizes) across the
    replicas, so their running hashes differ by design: comparing rank 0 with rank 1 reported a divergence that was
    not one (seen on a loaded machine, where both ranks' published marks overlapped). The peer is the same place in
    the next replica group."""
    from lightning_zero.strategy.fault_handling import symmetric_peer

    flat, hybrid = ZeroConfig(stage=2), ZeroConfig(stage=2, shard_size=2)
    assert [symmetric_peer(flat, r, 4, 4) for r in range(4)] == [1, 2, 3, 0]
    assert [symmetric_peer(hybrid, r, 4, 4) for r in range(4)] == [2, 3, 0, 1]
    assert [symmetric_peer(ZeroConfig(stage=3, shard_size="node"), r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    piped = ZeroConfig(stage=1, pipeline_stages=2)
    assert [symmetric_peer(piped, r, 4, 4) for r in range(4)] == [2, 3, 0, 1]
    assert symmetric_peer(piped, 0, 2, 2) is None
