"""Which ranks shard together and which hold copies: the data-parallel topology of flat and hybrid sharding.

[Note: hybrid sharding]
With ``shard_size=k`` the ``N`` ranks form ``R = N / k`` shard groups of ``k`` consecutive ranks (rank ``r`` is
in group ``r // k`` at position ``r % k``); the ranks at one position across the groups form a replica group
and hold the same rows. Consecutive ranks share a node under every launcher we support (torchrun, SLURM,
Lightning's), so a group of ``k = devices`` ranks is a node and only the replica groups cross nodes. A step
reduce-scatters each gradient bucket inside the shard group, all-reduces the shard across the replica
group (the only inter-node traffic), steps the optimizer on the shard and all-gathers inside the group again.
Every rank divides by ``N``: the gradients are averaged over every rank's batch, as in flat sharding.

The process groups come from one 2-D ``DeviceMesh`` ``(replicate, shard)``, as FSDP2's HSDP and torchtitan's
``dp_replicate x dp_shard`` build them; its ``"shard"`` sub-mesh is what DTensor checkpoints shard over.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_zero.engine.comm import collectives


@dataclasses.dataclass(frozen=True)
class Topology:
    """Pure arithmetic over ranks: nodes, shard groups and replica groups (no process group needed)."""

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
        """Copies of each row: the number of shard groups."""
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
    """Ranks a parameter's rows are spread over (None: every rank, flat sharding)."""
    replicate_group: dist.ProcessGroup | None
    """Ranks holding the same rows (None: no copies)."""
    shard_mesh: DeviceMesh | None
    """``shard_group`` as a 1-D mesh (None: built by the engine over every rank)."""

    @property
    def replicas(self) -> int:
        return self.topology.replicas


def data_parallel_groups(topology: Topology, device_type: str) -> DataParallelGroups:
    """The groups of ``topology`` (collective when hybrid: every rank builds the same mesh at the same point)."""
    if not topology.hybrid:
        return DataParallelGroups(topology, None, None, None)
    mesh = device_mesh(device_type, (topology.replicas, topology.shard_size), ("replicate", "shard"))
    return DataParallelGroups(topology, mesh.get_group("shard"), mesh.get_group("replicate"), mesh["shard"])


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A ``DeviceMesh`` of every rank in row-major order, with one process group per dimension. Collective:
    every rank builds the same mesh at the same point."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def new_group(timeout: timedelta | None = None, backend: str = "gloo") -> dist.ProcessGroup | None:
    """A new process group of every rank (collective: every rank calls it at the same point), for work that
    runs beside training (an asynchronous checkpoint's collectives, issued from a background thread) and so
    must never interleave with the training collectives on the world group. gloo by default: such work
    moves host-side objects. None when torch.distributed is not initialized."""
    if not collectives.is_distributed():
        return None
    group: dist.ProcessGroup = dist.new_group(backend=backend, timeout=timeout)
    return group
