"""What both engines' optimizer handles do alike (``stage12/sharded_optimizer.py``, ``stage3/fsdp2_optimizer.py``):
hold the user's optimizer, the owners of the parameters a matrix optimizer steps whole (``owner_step.py``) and the
offloaded step's schedule (``offload/schedule.py``), and answer the contract's questions that only wait on those. Each
engine's handle says which parameter an index is and where its rows and gradients live.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from lightning_zero.engine.api import ShardRecord
from lightning_zero.engine.offload.schedule import HostStepSchedule
from lightning_zero.engine.optimizers import Standins
from lightning_zero.engine.owner_step import OwnerStepping


class OptimizerShell:
    """The shared half of an :class:`~lightning_zero.engine.api.OptimizerShards`."""

    def __init__(self, optimizer: Optimizer, kind: str, schedule: HostStepSchedule) -> None:
        self.optimizer = optimizer
        self.kind = kind
        #: See ``offload/schedule.py``; it also serves runs without offload, where it never starts anything.
        self.schedule = schedule
        self.owners: OwnerStepping | None = None
        #: The engine's indices of the parameters stepped whole on an owner rank.
        self.whole: list[int] = []

    # ------------------------------------------------------------------ what each engine says
    def _param(self, i: int) -> torch.Tensor:
        """The module's parameter object for the engine's trainable parameter ``i``."""
        raise NotImplementedError

    def _ordered_records(self) -> list[ShardRecord]:
        raise NotImplementedError

    def _hosted_shards(self) -> dict[int, torch.Tensor]:
        """``id(param)`` -> the tensor the optimizer keys the state of a parameter stepped as a shard by."""
        raise NotImplementedError

    def _gradients(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _discard(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the contract, alike for both
    @property
    def _owners(self) -> OwnerStepping:
        if self.owners is None:
            raise RuntimeError("lightning_zero internal error: only a matrix optimizer steps parameters whole")
        return self.owners

    def owners_of(self) -> dict[int, int] | None:
        if self.owners is None:
            return None
        return {id(self._param(i)): self.owners.owner[i] for i in self.whole}

    def settle(self) -> None:
        """Wait for the host steps in flight before the masters or the optimizer state are read."""
        self.schedule.settle()

    def state_loaded(self) -> None:
        self.schedule.states.conform(self.optimizer)

    def records(self) -> list[ShardRecord]:
        self.schedule.wait_started()  # their gradients are averaged in the worker
        return self._ordered_records()

    def hosted(self) -> dict[int, torch.Tensor]:
        """``id(param)`` -> the tensor the optimizer keys that parameter's state by, where it is not the parameter
        itself (none where another rank owns it)."""
        self.settle()
        hosted = self._hosted_shards()
        if self.owners is not None:
            owned = self.owners.whole
            hosted.update({id(self._param(i)): owned[i] for i in self.whole if i in owned})
        return hosted

    def _owner_standins(self) -> Standins:
        """Parameters stepped whole: this rank's whole copies where it owns them, else they sit the step out."""
        standins: Standins = {}
        for i in self.whole:
            owned = self._owners.whole.get(i)
            standins[id(self._param(i))] = None if owned is None else (owned, self._owners.grads.get(i))
        return standins

    def local_gradients(self, for_change: bool = False) -> list[torch.Tensor]:
        """``for_change``: the caller is about to change them, which parts stepped during backward forbid; speculated
        parts are put back instead, to be stepped after the change."""
        if for_change:
            if self.schedule.speculated:
                self.schedule.undo_started()
            self.schedule.refuse("change the gradients now")
        self.schedule.wait_started()
        return self._gradients()

    def discard_gradients(self) -> None:
        """A skipped step."""
        if self.schedule.speculated:
            self.schedule.undo_started()
        self.schedule.refuse("skip this optimizer step")
        self._discard()

    def speculated_norms(self) -> dict[int, torch.Tensor] | None:
        if not self.schedule.speculated:
            return None
        return self.schedule.speculated_norms()

    def undo_speculation(self) -> None:
        self.schedule.undo_started()
