"""The run's first failure, kept in the process group's key-value store so that every rank's error names it.

When one rank raises (say in ``training_step``), its peers are usually blocked inside a collective; with
gloo they get "connection closed by peer" as soon as that rank's process exits, with NCCL nothing at all,
and neither says anything about the cause. The first rank to fail (or the first watchdog to diagnose a
hang) therefore records the failure under the run's namespace with ``compare_set``, so exactly one wins,
and every rank that fails afterwards names that first failure in its own error message.

The namespace is per run (``lightning_zero/<run id>``): successive Trainers in one process group and
torchrun restarts share the store, and an earlier run's failure must not leak into a later one.
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = "lightning_zero"
_NOTE = "\n[lightning_zero] "


def key(namespace: str) -> str:
    return f"{namespace}/first_failure"


def record(store: Any, namespace: str, failure: dict[str, Any]) -> dict[str, Any]:
    """Record ``failure`` unless another is recorded already; return the first one (maybe ``failure``)."""
    encoded = json.dumps(failure)
    first = store.compare_set(key(namespace), "", encoded).decode()
    return json.loads(first) if first else failure


def read(store: Any, namespace: str) -> dict[str, Any] | None:
    """The first failure, or None (``check`` first: a ``get`` of a missing key blocks for the store timeout)."""
    name = key(namespace)
    if not store.check([name]):
        return None
    raw = store.get(name)
    return json.loads(raw) if raw else None


def error_text(exception: BaseException) -> str:
    text = str(exception).split(_NOTE, 1)[0].strip()
    return f"{type(exception).__name__}: {text}" if text else type(exception).__name__


def add_note(exception: BaseException, note: str) -> None:
    """Append ``note`` to ``exception``'s message (Lightning re-raises the same object after ``on_exception``)."""
    text = _NOTE + note.replace("\n", "\n  ")
    if exception.args and isinstance(exception.args[0], str):
        if text in exception.args[0]:
            return
        exception.args = (exception.args[0] + text, *exception.args[1:])
    else:
        exception.args = (*exception.args, text)


def _headline(text: str | None) -> str:
    return (text or "").strip().split("\n", 1)[0]


def brought_down_by(exception: BaseException, first: dict[str, Any], rank: int) -> None:
    """Name ``first`` in ``exception`` unless it is this rank's own error or the same error (every rank raising
    the same check needs no note)."""
    if first.get("rank") == rank and first.get("kind") == "error":
        return
    if _headline(first.get("error")) == _headline(error_text(exception)):
        return  # the same error on every rank (a failed save's, raised alike everywhere), however its details read
    add_note(exception, f"the run was brought down by the first failure: {first['message']}")


_COMMUNICATION = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "timed out",
    "collective mismatch",
    "pair closure",
    "Broken pipe",
    "NCCL",
    "ProcessGroupGloo",
    "Socket Timeout",
)


def is_communication_error(exception: BaseException) -> bool:
    """Whether ``exception`` is the transport's word that a peer is gone or late, not a cause of its own."""
    if type(exception).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError"):
        return True
    return isinstance(exception, RuntimeError) and any(text in str(exception) for text in _COMMUNICATION)


#: torch's word when an operation meets a sharded parameter (a DTensor) beside plain tensors.
_MIXED_WITH_SHARDS = "got mixed torch.Tensor and DTensor"
SHARDED_CALL_HINT = (
    "Under stage 3 a unit's parameters are gathered only while the unit itself runs (its forward, its backward); "
    "elsewhere they are DTensor shards, which code meets when it calls a layer of a unit on its own outside a backward "
    "(`self.net[0](x)` where `net` is the unit: call the unit, or make that layer a unit of its own, `wrap_policy` "
    "naming its class), runs a unit other than through its `__call__` (`unit.forward(x)`, `unit.encode(x)`, which "
    "skip the hooks that gather it: make its layers the units, `wrap_policy` naming their classes), or computes with "
    "a unit's parameters outside its forward (a penalty `sum(p.square().sum() for p in self.parameters())` in "
    "`training_step`: use the optimizer's `weight_decay`, compute it in the unit's forward, or train at stage 1 or 2, "
    "which hold whole parameters)."
)


#: torch's word when ``torch.autograd.grad`` is asked for the gradient of a tensor the graph does not use.
_NOT_IN_THE_GRAPH = "appears to not have been used in the graph"
PARAMETER_GRAD_HINT = (
    "Under stage 3 a unit's parameters, as `module.parameters()` gives them outside the unit's forward, are its shards: "
    "the forward computed with gathered copies, so `torch.autograd.grad` with respect to the shards finds no path "
    "(with `allow_unused=True` it returns None for them). Gradients with respect to the parameters inside "
    "`training_step` (a gradient-norm penalty, meta-learning) need stage 1 or 2, which hold whole parameters."
)


def note_sharded_call(exception: BaseException, shards_parameters: bool = True) -> None:
    """Say why an operation met stage 3's shards, where torch's error names only the operator; ``shards_parameters``:
    the run holds its parameters as shards (``ZeroConfig.shards_parameters``)."""
    if isinstance(exception, RuntimeError) and _MIXED_WITH_SHARDS in str(exception):
        add_note(exception, SHARDED_CALL_HINT)
    elif shards_parameters and isinstance(exception, RuntimeError) and _NOT_IN_THE_GRAPH in str(exception):
        add_note(exception, PARAMETER_GRAD_HINT)
