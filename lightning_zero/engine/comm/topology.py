"""Which ranks shard together and which hold copies: the data-parallel topology of flat and hybrid sharding.

[Note: hybrid sharding]
With ``shard_size=k`` the ``N`` ranks form ``N / k`` shard groups of ``k`` consecutive ranks; the ranks at one position
across the groups form a replica group and hold the same rows. Consecutive ranks share a node under every launcher we
support (torchrun, SLURM, Lightning's), so a group of ``k = devices`` ranks is a node and only the replica all-reduce of
each shard crosses nodes. Every rank divides by ``N``, as in flat sharding.

The process groups come from one 2-D ``DeviceMesh`` ``(replicate, shard)``, as FSDP2's HSDP and torchtitan's
``dp_replicate x dp_shard`` build them; its ``"shard"`` sub-mesh is what DTensor checkpoints shard over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_zero.engine.comm import collectives

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Topology:
    world_size: int
    node_size: int
    shard_size: int
    """Ranks a parameter's rows are spread over (``world_size`` for flat sharding)."""

    def __post_init__(self) -> None:
        for name in ("node_size", "shard_size"):
            size = getattr(self, name)
            if size < 1 or self.world_size % size:
                raise ValueError(f"{name}={size} must divide world_size={self.world_size}")

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def hybrid(self) -> bool:
        return self.replicas > 1

    def shard_ranks(self, rank: int) -> tuple[int, ...]:
        first = rank - rank % self.shard_size
        return tuple(range(first, first + self.shard_size))

    def replica_ranks(self, rank: int) -> tuple[int, ...]:
        return tuple(range(rank % self.shard_size, self.world_size, self.shard_size))

    def spans_nodes(self, ranks: tuple[int, ...]) -> bool:
        return len({r // self.node_size for r in ranks}) > 1


@dataclasses.dataclass
class DataParallelGroups:
    """The process groups of one run's data parallelism (see [Note: hybrid sharding])."""

    topology: Topology
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    shard_mesh: DeviceMesh | None

    @property
    def replicas(self) -> int:
        return self.topology.replicas


def data_parallel_groups(topology: Topology, device_type: str) -> DataParallelGroups:
    """Collective when hybrid: every rank builds the same mesh at the same point."""
    if not topology.hybrid:
        return DataParallelGroups(topology, None, None, None)
    mesh = device_mesh(device_type, (topology.replicas, topology.shard_size), ("replicate", "shard"))
    return DataParallelGroups(topology, mesh.get_group("shard"), mesh.get_group("replicate"), mesh["shard"])


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    """Collective on first use: every rank asks for the same mesh at the same point (see
    [Note: groups live as long as the world])."""
    from torch.distributed.device_mesh import init_device_mesh

    return _kept(
        ("mesh", device_type, tuple(shape), names), lambda: init_device_mesh(device_type, shape, mesh_dim_names=names)
    )


def new_group(purpose: str, timeout: timedelta | None = None, backend: str = "gloo") -> dist.ProcessGroup | None:
    """A process group for work that runs beside training (an asynchronous checkpoint's collectives), which must never
    interleave with the training collectives on the world group, nor with another ``purpose``'s. gloo by default: such
    work moves host-side objects. Collective on first use, as :func:`device_mesh`."""
    if not collectives.is_distributed():
        return None
    group = _kept(("group", purpose, backend, timeout), lambda: dist.new_group(backend=backend, timeout=timeout))
    if not isinstance(group, dist.ProcessGroup):  # torch 2.14 types a non-member's -100 into new_group's result
        raise RuntimeError(f"the process group for {purpose} holds every rank, yet torch returned {group!r} here")
    return group


# [Note: groups live as long as the world]
# Building a mesh or a group is collective and creates communicators: under gloo a socket loop and worker threads per
# group on every member, which take CPU even when idle; under NCCL device memory. One process often runs several ``fit``
# calls (a sweep, a notebook), so each mesh and side group is built once per world group and handed out again, as
# Lightning keeps the world group itself. A new world group (after ``destroy_process_group()``) starts afresh. Every
# rank makes the same requests in the same order, so every rank finds the same ones built.
_KEPT: dict[tuple[object, ...], object] = {}
_KEPT_WORLD: list[object] = [None]


def _kept(key: tuple[object, ...], build: Callable[[], T]) -> T:
    world = dist.group.WORLD
    if _KEPT_WORLD[0] is not world:
        _KEPT.clear()
        _KEPT_WORLD[0] = world
    if key not in _KEPT:
        _KEPT[key] = build()
    return _KEPT[key]  # type: ignore[return-value]
