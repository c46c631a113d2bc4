"""Autograd's private pieces: the generator behind non-reentrant checkpointing, the running graph task, and a
callback at the end of the running backward."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator

__all__ = [
    "DEFAULT_DETERMINISM_MODE",
    "checkpoint",
    "checkpoint_without_reentrant_generator",
    "current_graph_task_id",
    "queue_callback",
]

#: torch's composable ``checkpoint`` (a forward pre-hook and a forward hook around the module's own forward) and the
#: generator both it and ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` run, with its default mode.
DEFAULT_DETERMINISM_MODE = _DEFAULT_DETERMINISM_MODE
checkpoint_without_reentrant_generator = _checkpoint_without_reentrant_generator

#: The running autograd graph task, -1 outside backward (a torch that lacks it: never a graph-building backward).
current_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward ends (as DDP and FSDP do); RuntimeError outside a backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
