"""Rank program for test_shm_transport.py: the shared-memory collectives against the socket ring, on the world
group and on two sub-groups, with mailboxes small enough that every collective takes several rounds."""

from __future__ import annotations

import glob
import sys

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives, p2p_transport, shm_transport
from tests.launch import ensure_process_group, run_cases


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _compare(group, size: int, numel: int, dtype: torch.dtype) -> dict:
    """One all-gather and one reduce-scatter through the mailboxes, checked against every rank's inputs
    (regenerated here from their seeds) and against the socket ring."""
    ranks = collectives.group_ranks(group)
    me = ranks.index(dist.get_rank())
    seg = numel // size
    gathered = torch.empty(numel, dtype=dtype)
    collectives.all_gather(gathered, _inputs(ranks[me], numel, dtype)[:seg].clone(), group=group)
    expected = torch.cat([_inputs(r, numel, dtype)[:seg] for r in ranks])
    reduced = torch.empty(seg, dtype=dtype)
    collectives.reduce_scatter(reduced, _inputs(ranks[me], numel, dtype).clone(), group=group)
    rank_order = _inputs(ranks[0], numel, dtype)[me * seg : (me + 1) * seg].clone()
    for r in ranks[1:]:
        rank_order += _inputs(r, numel, dtype)[me * seg : (me + 1) * seg]
    ring = torch.empty(seg, dtype=dtype)
    p2p_transport.RingReduceScatter(ring, _inputs(ranks[me], numel, dtype).clone(), group).wait()
    return {
        "gather_equal": torch.equal(gathered, expected),
        "reduce_equal_rank_order": torch.equal(reduced, rank_order),
        "reduce_vs_ring": (reduced.float() - ring.float()).abs().max().item(),
    }


def collectives_case() -> dict:
    shm_transport.MAILBOX_BYTES = 4096  # every collective below takes several rounds
    world = dist.get_world_size()
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        report[f"world_{dtype}"] = _compare(None, world, world * 3001, dtype)
    report["world_served"] = shm_transport.for_group(None) is not None
    if world == 4:  # two groups of two, each with its own mailboxes
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = pairs[dist.get_rank() // 2]
        report["pair"] = _compare(mine, 2, 2 * 2049, torch.float32)
        report["pair_served"] = shm_transport.for_group(mine) is not None
    collectives.barrier()
    report["files_left"] = glob.glob("/dev/shm/lightning_zero-*")
    return report


if __name__ == "__main__":
    ensure_process_group()
    run_cases({"collectives": collectives_case}, sys.argv[1:])
