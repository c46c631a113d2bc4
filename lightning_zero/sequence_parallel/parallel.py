"""A rank's place in sequence parallelism, and what a module asks of it.

:class:`SequenceParallel` holds the group of ``k`` consecutive ranks that share each sample (a ``(data, sequence)``
device mesh, as DeepSpeed lays its groups out) and the current batch's :class:`~.batch.SequenceShard`. While the
strategy runs a step it is the *active* one, which the helpers below and the attention read.

The helpers are for modules that are not Hugging Face causal LMs (those get their positions and labels from the
strategy, ``causal_lm.py``): :func:`positions` gives a rank its global positions (a module that builds them with
``torch.arange(T)`` would give every rank positions ``0..T/k-1``), :func:`local_slice` cuts a whole-sequence tensor
the module holds itself, and :func:`group_mean` makes a loss the mean over the tokens of the whole group. Outside
sequence parallelism they are the identity (``positions`` is ``arange``), so a module can call them always.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.topology import device_mesh
from lightning_zero.sequence_parallel.batch import SequenceShard, batch_checksum, sequence_tensor, split_batch
from lightning_zero.sequence_parallel.exchange import group_sum

_ACTIVE: list[SequenceParallel | None] = [None]


class SequenceParallel:
    """This rank's sequence-parallel group and the current batch's cut. ``group`` None: the planner's trace of rank 0
    of a group of ``size`` (``exchange.py`` keeps the shapes, not the numbers)."""

    def __init__(
        self,
        size: int,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        device: torch.device | None = None,
    ) -> None:
        self.group = group
        self.device = device or torch.device("cpu")  # where the group's collectives take their tensors
        self.size = size
        self.rank = rank % size  # within the group
        self.data_parallel_rank = rank // size
        self.shard: SequenceShard | None = None
        #: The current batch's positions were asked for (:func:`positions`) or handed to a Hugging Face model.
        self.positions_given = False
        #: Attention calls exchanged across the group since the batch was cut (none: the module's attention is not
        #: one sequence parallelism reaches, and it attended over this rank's positions only).
        self.exchanges = 0
        #: Batches of the running loop still to compare over the group (:meth:`check_same_batch`).
        self.checks_left = 0

    @classmethod
    def across(cls, size: int, rank: int, world_size: int, device: torch.device) -> SequenceParallel:
        """The groups of ``size`` consecutive ranks (collective: every rank builds them at the same point)."""
        if world_size % size:
            raise ZeroConfigError(
                f"`sequence_parallel_size={size}` must divide the number of processes ({world_size}): each "
                f"sample is shared by {size} ranks."
            )
        mesh = device_mesh(device.type, (world_size // size, size), ("data", "sequence"))
        return cls(size, rank, world_size, mesh.get_group("sequence"), device)

    def split(self, batch: Any) -> Any:
        """This rank's part of ``batch`` (``batch.py``); the cut is kept for the step."""
        batch, self.shard = split_batch(batch, self.size, self.rank)
        self.positions_given = False
        self.exchanges = 0
        return batch

    def check_from_here(self, batches: int = 2) -> None:
        """Compare the next ``batches`` batches (called as each loop starts, on every rank alike)."""
        self.checks_left = batches

    def check_same_batch(self, batch: Any) -> None:
        """The group's ranks were given the same batch: a sampler made without ``trainer.distributed_sampler_kwargs``,
        or data randomised per rank, would have attention mix the keys of different samples. A checksum of the
        sequence tensor (read before it is moved) is gathered over the group, whose ranks always see equally many
        batches (groups may not: Lightning's predict sampler deals the replicas unequally). Only the first batches of
        each loop: reading the result waits for the device, which every step would pay for; both causes show there."""
        if self.group is None or self.checks_left <= 0:
            return
        self.checks_left -= 1
        ids = sequence_tensor(batch)
        mine = torch.tensor([batch_checksum(ids) if ids is not None else -1], dtype=torch.int64, device=self.device)
        sums = torch.empty(self.size, dtype=torch.int64, device=self.device)
        collectives.all_gather(sums, mine, group=self.group)
        gathered = sums.tolist()
        for index, checksum in enumerate(gathered):
            if checksum != gathered[0]:
                first = self.data_parallel_rank * self.size
                raise ZeroConfigError(
                    f"`sequence_parallel_size={self.size}`: ranks {first} and {first + index} share each sample but "
                    "were given different batches. Let Lightning make the sampler (or build your own "
                    "DistributedSampler with `**trainer.distributed_sampler_kwargs`, which counts the data-parallel "
                    "replicas), and seed any randomness in the data the same on the ranks of a group."
                )

    def positions(self, local_length: int, device: torch.device | str | None = None) -> torch.Tensor:
        shard = self._shard("positions")
        if local_length != shard.local_length:
            raise ZeroConfigError(
                f"lightning_zero.sequence_parallel.positions({local_length}): this rank holds {shard.local_length} "
                f"of the batch's {shard.length} positions; pass the length of the sequence the module got."
            )
        self.positions_given = True
        return torch.arange(shard.offset, shard.offset + local_length, device=device)

    def local_slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        shard = self._shard("local_slice")
        if tensor.shape[dim] != shard.length:
            raise ZeroConfigError(
                f"lightning_zero.sequence_parallel.local_slice: the tensor has {tensor.shape[dim]} positions along "
                f"dim {dim}, not the batch's {shard.length}."
            )
        return tensor.narrow(dim, shard.offset, shard.local_length)

    def _shard(self, helper: str) -> SequenceShard:
        if self.shard is None:
            raise ZeroConfigError(
                f"lightning_zero.sequence_parallel.{helper} was called before the strategy cut a batch: call it "
                "inside a step, on the batch the step was given."
            )
        return self.shard


def active() -> SequenceParallel | None:
    """The sequence parallelism of the step running now (None outside one, or without it)."""
    return _ACTIVE[0]


def activate(sequence: SequenceParallel | None) -> None:
    _ACTIVE[0] = sequence


def sequence_length(local_length: int) -> int:
    """The whole sequence's length for the ``local_length`` positions a module was given: ``k`` times it inside a
    sequence-parallel step, itself otherwise (a module checks its position table against it)."""
    sequence = active()
    return local_length if sequence is None else local_length * sequence.size


def positions(local_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """This rank's global positions for a sequence of ``local_length`` it was given: ``offset .. offset +
    local_length - 1`` under sequence parallelism, ``0 .. local_length - 1`` otherwise."""
    sequence = active()
    if sequence is None:
        return torch.arange(local_length, device=device)
    return sequence.positions(local_length, device)


def local_slice(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's part of a tensor that spans the batch's whole sequence along ``dim`` (the tensor itself without
    sequence parallelism)."""
    sequence = active()
    return tensor if sequence is None else sequence.local_slice(tensor, dim)


def group_mean(total: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """``total / count`` summed over the group's ranks first: the mean of a per-token loss over the whole sample
    when each rank passes the sum over its tokens and how many count. Its gradient is the one data parallelism over
    the group's ranks averages right. Without sequence parallelism: ``total / count``."""
    sequence = active()
    if sequence is None:
        return total / count
    count = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    return group_sum(total, sequence.group) / group_sum(count.detach(), sequence.group).detach()
