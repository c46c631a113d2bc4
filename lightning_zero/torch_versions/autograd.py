"""Autograd's private pieces: the generator behind non-reentrant checkpointing, the running graph task, and a
callback at the end of the running backward."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed._composable import checkpoint
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator

__all__ = [
    "DEFAULT_DETERMINISM_MODE",
    "checkpoint",
    "checkpoint_without_reentrant_generator",
    "current_function_modes",
    "current_graph_task_id",
    "inside_reentrant_checkpoint",
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


def inside_reentrant_checkpoint() -> bool:
    """The caller runs inside ``torch.utils.checkpoint(..., use_reentrant=True)``'s forward (its
    ``CheckpointFunction.forward`` is on the stack): that checkpoint recomputes in backward, outside any torch-function
    mode, and nothing of it but this frame tells it from an ordinary ``no_grad`` block."""
    forward = torch_checkpoint.CheckpointFunction.forward.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is forward:
            return True
        frame = frame.f_back
    return False


def current_function_modes() -> list[TorchFunctionMode]:
    """The torch-function modes entered now, outermost first: a checkpoint's recomputation runs in backward, where
    the modes its forward ran under are not entered, so it enters them again."""
    return [mode for mode in _get_current_function_mode_stack() if isinstance(mode, TorchFunctionMode)]
