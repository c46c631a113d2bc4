"""What this process communicated: elements and bytes per collective kind and per process group, each group
classified as intra-node or inter-node from the cluster's node layout.

[Note: counting convention]
A reduce-scatter counts the elements of its (full) input, an all-gather the elements of its (full) output, a
broadcast and a point-to-point send the elements of their tensor, and an all-reduce twice its tensor (it is
a reduce-scatter plus an all-gather, which is also what a ring moves). DDP's all-reduce of ``P`` gradients
thus counts ``2P``, a ZeRO-1/2 step ``P + P = 2P`` and a ZeRO-3 step ``3P`` (forward all-gather, backward
all-gather, reduce-scatter). Hybrid sharding over groups of ``k`` adds, across groups, the all-reduce of each
rank's ``P/k`` gradient shard: ``2P/k``.

A group is inter-node when its ranks sit on more than one node; nodes are ``node_size`` consecutive ranks
(:func:`set_node_size`; until a run sets it, the whole world is one node).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch


@dataclasses.dataclass
class GroupTraffic:
    """One process group's share of the counts."""

    ranks: tuple[int, ...]
    inter_node: bool
    elements: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))


@dataclasses.dataclass
class CommStats:
    """Calls, elements and bytes per collective kind and per group, since the last :meth:`reset`."""

    node_size: int | None = None
    groups: dict[tuple[int, ...], GroupTraffic] = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def record(self, kind: str, tensor: torch.Tensor, ranks: tuple[int, ...], times: int = 1) -> None:
        self.record_elements(kind, tensor.numel() * times, tensor.element_size(), ranks)

    def record_elements(self, kind: str, numel: int, itemsize: int, ranks: tuple[int, ...]) -> None:
        """For a collective without a buffer of that size (stages 1-2's exchanges in place)."""
        with self._lock:
            traffic = self.groups.get(ranks)
            if traffic is None:
                traffic = self.groups[ranks] = GroupTraffic(ranks, self.spans_nodes(ranks))
            traffic.calls[kind] += 1
            traffic.elements[kind] += numel
            traffic.bytes[kind] += numel * itemsize

    def spans_nodes(self, ranks: tuple[int, ...]) -> bool:
        if not self.node_size or not ranks:
            return False
        return len({rank // self.node_size for rank in ranks}) > 1

    def set_node_size(self, node_size: int | None) -> None:
        """Reclassifies the groups counted so far."""
        with self._lock:
            self.node_size = node_size
            for traffic in self.groups.values():
                traffic.inter_node = self.spans_nodes(traffic.ranks)

    def reset(self) -> None:
        with self._lock:
            self.groups.clear()

    def snapshot(self) -> dict[str, Any]:
        """A plain dict: per-kind ``calls``/``elements_by_kind``/``bytes_by_kind``, ``elements`` and ``bytes``
        totals, the same split ``intra_node``/``inter_node``, and ``by_group`` (``"0,1"`` -> its counts)."""
        with self._lock:
            groups = list(self.groups.values())
        out: dict[str, Any] = {
            "calls": _sum(g.calls for g in groups),
            "elements_by_kind": _sum(g.elements for g in groups),
            "bytes_by_kind": _sum(g.bytes for g in groups),
        }
        out["elements"], out["bytes"] = sum(out["elements_by_kind"].values()), sum(out["bytes_by_kind"].values())
        for where, inter in (("intra_node", False), ("inter_node", True)):
            chosen = [g for g in groups if g.inter_node is inter]
            out[f"elements_{where}"] = sum(sum(g.elements.values()) for g in chosen)
            out[f"bytes_{where}"] = sum(sum(g.bytes.values()) for g in chosen)
        out["by_group"] = {
            ",".join(map(str, g.ranks)): {
                "inter_node": g.inter_node,
                "calls": dict(g.calls),
                "elements_by_kind": dict(g.elements),
                "bytes_by_kind": dict(g.bytes),
            }
            for g in groups
        }
        return out


def _sum(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for count in counts:
        for kind, value in count.items():
            total[kind] += value
    return dict(total)
