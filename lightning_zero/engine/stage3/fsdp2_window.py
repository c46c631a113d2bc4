"""Stage 3's gathered copies: held from an accumulation window's first forward to its last backward, and what code
writes into them taken into the shards.

[Note: gathered accumulation windows]
With ``accumulate_grad_batches=k``, the k-1 non-final micro-batches run under ``no_sync``: every gradient is kept whole
and unreduced until the window's last backward, so a rank already holds the whole model's gradients through the window.
FSDP2 would still reshard each unit after its forward and again after its backward, and gather it twice per micro-batch:
2kP elements a window, where DDP and stages 1-2 move 2P. Keeping the gathered parameters until the last backward (the
trade FSDP2's ``reshard_after_backward=False`` offers) leaves one gather in the window's first forward and the
reduce-scatter of its last backward. The price is the whole model's gathered parameters held through the window, beside
the whole gradients it holds already. Numbers do not change. ``reduce_every_microbatch=True`` keeps the ZeRO-3 footprint
throughout, and so does ``offload_params``, whose point is that the parameters leave the device.

While the window is open a group reshards only after a backward that reduces. That setting alone would not hold the
root's own parameters: when ``training_step`` calls ``self(...)``, FSDP2's outer post-forward reshards the root whatever
its setting says ([Note: hpZ and the root] in ``fsdp2_units.py``).

The window closes after the backward that reduces, so every unit is sharded again before the optimizer step. Anything
that must see the sharded module in between (an evaluation loop, a checkpoint) closes the window first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_zero.engine.stage3 import fsdp2_private


class GatheredWindow:
    """Holds every FSDP2 unit of ``root`` gathered through an accumulation window (see the Note above)."""

    def __init__(self, root: nn.Module) -> None:
        self.groups = fsdp2_private.param_groups(root)
        #: Each group's reshard-after-forward setting while the window is open; None: closed.
        self._after_forward: list[Any] | None = None
        self._reshards: list[Callable[[], None]] = []

    def hold(self) -> None:
        if self._after_forward is None:
            self._after_forward = [fsdp2_private.keep_gathered_after_forward(group) for group in self.groups]
            self._reshards = [fsdp2_private.reshard_only_after_backward(group) for group in self.groups]
        for group in self.groups:
            group.reshard_after_backward = False

    def release_after_backward(self) -> None:
        for group in self.groups:
            group.reshard_after_backward = True

    def close(self) -> None:
        if self._after_forward is None:
            return
        for group, after_forward, reshard in zip(self.groups, self._after_forward, self._reshards):
            fsdp2_private.unshadow_reshard(group, reshard)
            group.reshard_after_backward = True
            fsdp2_private.restore_after_forward(group, after_forward)
        self._after_forward, self._reshards = None, []
        for group in self.groups:
            if group.is_unsharded:
                group.reshard()


def hold_root_gathered(root: nn.Module) -> Callable[[], None]:
    """Keep the root's own parameters gathered across a nested forward of the root (``self(x)`` inside
    ``training_step``): code after it in the step (an auxiliary loss, a tied weight) would meet shards. The outer
    post-forward still reshards them (see [Note: hpZ and the root] in ``fsdp2_units.py``), so memory and traffic do not
    change. Returns what puts the setting back, to call before that outer post-forward."""
    if not isinstance(root, FSDPModule):
        return lambda: None
    held = [(group, fsdp2_private.keep_gathered_after_forward(group)) for group in fsdp2_private.own_groups(root)]

    def restore() -> None:
        for group, setting in held:
            fsdp2_private.restore_after_forward(group, setting)

    return restore


class GatheredWrites:
    """[Note: writes into gathered parameters]
    While FSDP2 holds a unit gathered, the module's parameters are the gathered copies: code that writes a parameter in
    place writes the copy, and resharding frees it with the write. Such code is common where a parameter is state rather
    than a weight: an EMA codebook of a VQ-VAE updated inside ``training_step``, a momentum teacher moved between the
    micro-batches of an accumulation window (BYOL, MoCo, DINO). ``ddp`` and stages 1-2 keep such writes.

    So each gathered parameter's version counter is noted when a gather lands, and before the unit reshards a
    parameter written since is copied into its shard, through the sharded parameter so that its own version counts the
    write (offloaded masters take it in: [Note: parameters written between steps]). Under mixed precision the write
    reaches the fp32 shard at the compute dtype's precision. A write into ``.data`` moves no version counter and is
    not seen: write to the parameter under ``torch.no_grad()``, or hold such state in buffers, which FSDP2 leaves
    whole on every rank.
    """

    def __init__(self, groups: Iterable[Any]) -> None:
        self._versions: dict[int, dict[int, int]] = {}
        for group in groups:
            fsdp2_private.watch_gathering(group, self._gathered, self._resharding)

    def _gathered(self, group: Any) -> None:
        self._versions[id(group)] = fsdp2_private.gathered_versions(group)

    def _resharding(self, group: Any) -> None:
        if marks := self._versions.pop(id(group), None):
            fsdp2_private.write_back_gathered(group, marks)
