"""One checkpoint format, two front ends: the ``Trainer``'s layout and a Fabric loop's.

The ``Trainer`` strategy writes Lightning's layout: ``state_dict`` (the module), ``optimizer_states`` and
``lr_schedulers`` (lists in the trainer's order), and the trainer's own entries (``epoch``, ``loops``, ...). A Fabric
loop saves a dictionary it names itself (``{"model": model, "optimizer": optimizer, "step": 3}``). The Fabric strategy
writes Lightning's layout too: the module's state as ``state_dict``, the optimizers' and schedulers' in the order the
loop's dictionary lists them, every other entry under its own key, and :data:`FABRIC_KEYS` recording which keys the
module, optimizers and schedulers had. So every reader (a ``Trainer`` resuming, ``lightning-zero consolidate``, the
sharded loader) reads both, and a Fabric loop reads a ``Trainer``'s checkpoint by the objects its dictionary holds.

The one exception is a full file (``state_dict_type="full"``) a Fabric loop writes: it holds the loop's own keys, as
Fabric's strategies write it (``torch.load(path, weights_only=True)["model"]`` is the module's state dict). Readers
bring it back to Lightning's layout first (:func:`as_lightning`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The entry recording a Fabric loop's keys (:class:`FabricKeys`, as a plain dict so ``weights_only`` loads it).
FABRIC_KEYS = "lightning_zero_fabric_keys"
#: In :data:`FABRIC_KEYS`: the entries are under the loop's keys (a full file), not Lightning's.
_UNDER_OWN_KEYS = "under_own_keys"
#: Lightning's entries for the module, the optimizers and the schedulers.
LIGHTNING_ENTRIES = ("state_dict", "optimizer_states", "lr_schedulers")


@dataclass(frozen=True)
class FabricKeys:
    """The keys a Fabric loop's dictionary gave the module, its optimizers and its schedulers."""

    module: str
    optimizers: tuple[str, ...] = ()
    schedulers: tuple[str, ...] = ()

    def as_entry(self) -> dict[str, Any]:
        return {"module": self.module, "optimizers": list(self.optimizers), "schedulers": list(self.schedulers)}

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> FabricKeys:
        return cls(str(entry["module"]), tuple(entry["optimizers"]), tuple(entry["schedulers"]))


def as_lightning(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` in Lightning's layout: a full file a Fabric loop wrote with its keys renamed, any other as is."""
    entry = checkpoint.get(FABRIC_KEYS)
    if entry is None or not entry.get(_UNDER_OWN_KEYS):  # a sharded directory's meta.pt is in Lightning's layout
        return checkpoint
    keys = FabricKeys.from_entry(entry)
    out = {k: v for k, v in checkpoint.items() if k not in (keys.module, *keys.optimizers, *keys.schedulers)}
    out[FABRIC_KEYS] = keys.as_entry()
    out["state_dict"] = checkpoint[keys.module]
    out["optimizer_states"] = [checkpoint[k] for k in keys.optimizers if k in checkpoint]
    out["lr_schedulers"] = [checkpoint[k] for k in keys.schedulers if k in checkpoint]
    return out


def as_full_file(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What a full file holds: a Fabric loop's checkpoint under its own keys (see the module docstring); a
    ``Trainer``'s as is."""
    entry = checkpoint.get(FABRIC_KEYS)
    if entry is None:
        return checkpoint
    keys = FabricKeys.from_entry(entry)
    out = {k: v for k, v in checkpoint.items() if k not in LIGHTNING_ENTRIES}
    out[FABRIC_KEYS] = {**keys.as_entry(), _UNDER_OWN_KEYS: True}
    out[keys.module] = checkpoint["state_dict"]
    out.update(zip(keys.optimizers, checkpoint.get("optimizer_states", [])))
    out.update(zip(keys.schedulers, checkpoint.get("lr_schedulers", [])))
    return out
