"""The hooks that make a module's forward keep only its inputs and recompute in backward.

[Note: a recomputation per backward]
torch's composable ``checkpoint`` (``torch.distributed._composable``) registers a forward pre-hook and a forward
hook around torch's non-reentrant checkpoint, and is what keeps names and ``state_dict`` keys unchanged. It hands
the checkpoint a context for the recomputation that can be entered once per forward (a generator-based one that
turns its own hooks off). A forward whose graph is differentiated twice recomputes twice: a gradient penalty
(``torch.autograd.grad(..., create_graph=True)`` in ``training_step``, then the loss's backward) fails on the
second with ``AttributeError: '_GeneratorContextManager' object has no attribute 'args'``, while
``torch.utils.checkpoint.checkpoint`` itself (reusable contexts) recomputes as often as asked. So the module is
still marked with torch's composable ``checkpoint`` (``checkpoint.state(module)`` says it is checkpointed, and
its hooks stay off), and these hooks, the same two in the same places, drive the checkpoint with a context that
can be entered again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lightning_zero.activation_checkpointing.offload import ActivationOffload
from lightning_zero.activation_checkpointing.recomputed_buffers import BufferUpdates, ForwardBuffers
from lightning_zero.torch_versions.autograd import (
    DEFAULT_DETERMINISM_MODE,
    checkpoint,
    checkpoint_without_reentrant_generator,
    current_function_modes,
)


class _CheckpointedForward:
    """One module's checkpointing: the forward generator between its pre-hook and its hook, whether the hooks act
    (not while the module's forward is being recomputed), the buffers its forward updates, and where its inputs
    are kept (on the host with ``offload``: [Note: offloaded checkpoint inputs])."""

    def __init__(self, module: nn.Module, offload: ActivationOffload | None) -> None:
        self.active = True
        self.offload = offload
        self.generator: Generator[None, None, None] | None = None
        self.buffers = BufferUpdates(module)
        self.forward: ForwardBuffers | None = None

    def contexts(self) -> tuple[contextlib.nullcontext[None], _Recomputing]:
        """Called by torch's checkpoint as the forward begins."""
        self.forward = self.buffers.begin()
        return contextlib.nullcontext(), _Recomputing(self, self.forward, current_function_modes())

    def before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.active:
            return
        function: Any = module
        offloaded = (
            self.offload.start(module, args, kwargs) if self.offload is not None and torch.is_grad_enabled() else None
        )
        if offloaded is not None:
            function, args, kwargs = offloaded
        self.generator = checkpoint_without_reentrant_generator(
            function, True, self.contexts, DEFAULT_DETERMINISM_MODE, False, True, *args, **kwargs
        )
        next(self.generator)

    def after_forward(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        generator, self.generator = self.generator, None
        forward, self.forward = self.forward, None
        if self.active and forward is not None:
            self.buffers.end(forward)
        if self.active and generator is not None:
            try:
                next(generator)
            except StopIteration:
                return
            raise RuntimeError("lightning_zero internal error: an activation checkpoint's forward did not finish")


class _Recomputing:
    """The recomputation's context: the hooks off while the module's forward runs again, as often as asked, the
    buffers that forward updated as it found them (see [Note: buffers under recomputation]), and the torch-function
    modes the forward ran under (sequence parallelism's attention: ``sequence_parallel/attention.py``) entered again,
    since backward runs without them."""

    def __init__(self, state: _CheckpointedForward, buffers: ForwardBuffers | None, modes: list[Any]) -> None:
        self.state = state
        self.buffers = buffers
        self.was_active = True
        self.modes = modes
        self.entered = contextlib.ExitStack()

    def __enter__(self) -> None:
        self.was_active, self.state.active = self.state.active, False
        if self.buffers is not None:
            self.buffers.__enter__()
        entered = current_function_modes()
        for mode in self.modes:
            if not any(mode is other for other in entered):
                self.entered.enter_context(mode)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.entered.close()
        self.state.active = self.was_active
        if self.buffers is not None:
            self.buffers.__exit__(kind, error, trace)


def checkpoint_forward(module: nn.Module, offload: ActivationOffload | None = None) -> None:
    """Checkpoint ``module``'s forward (see [Note: a recomputation per backward]), its inputs kept on the host when
    ``offload`` is given; a module already checkpointed with torch's composable ``checkpoint`` is left as it is."""
    if checkpoint.state(module) is not None:
        return
    checkpoint(module)
    checkpoint.state(module).enable_hook = False
    state = _CheckpointedForward(module, offload)
    module.register_forward_pre_hook(state.before_forward, with_kwargs=True, prepend=True)
    module.register_forward_hook(state.after_forward, prepend=True, always_call=True)
