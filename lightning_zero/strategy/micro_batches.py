"""One training step over several micro-batches: ``stage="auto"`` chose a micro-batch smaller than the batch the
DataLoader gives, so the strategy splits each batch and accumulates over its parts inside the step.

[Note: a batch's parts in Lightning's order]
Lightning's automatic optimization runs ``training_step``, then ``zero_grad`` (at a window's first batch), then
``backward``. So ``training_step`` runs the first part's step only and returns its output; ``backward`` runs that
part's backward, then each further part's ``training_step`` and backward. Every part but the last is a non-final
micro-batch (no gradient communication), and each part's loss is divided by the number of splits (and, as Lightning
divides it, by ``accumulate_grad_batches``). That is the hand-written configuration's step (the DataLoader's batch
divided by the splits, ``accumulate_grad_batches`` multiplied by them) in its order: forward and backward of each
micro-batch in turn, the hooks around each backward, then clipping and the optimizer step. So a parameter after ``N``
steps is the hand-written configuration's. A batch with fewer samples (an epoch's last) gives fewer parts, each scaled
as before, as the hand-written DataLoader gives fewer micro-batches.

What Lightning records as the step's loss (the progress bar, ``outputs``) is the first part's; ``self.log`` in
``training_step`` is called once per part, with that part's values, as under the hand-written configuration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_zero.planning.auto import AutoChoice
from lightning_zero.torch_versions.tracing import tree_leaves, tree_map_only


def split(batch: Any, micro_batch: int) -> list[Any]:
    """``batch`` (a tensor, or dicts, lists and tuples of tensors sharing their first dimension: ``planning.auto
    .splittable``) in parts of ``micro_batch`` samples, the last one shorter where they do not divide."""
    size = tree_leaves(batch)[0].shape[0]

    def part(start: int) -> Any:
        return tree_map_only(torch.Tensor, lambda t: t[start : start + micro_batch], batch)

    return [part(start) for start in range(0, size, micro_batch)]


def _loss(output: Any) -> torch.Tensor | None:
    if isinstance(output, Mapping):
        return output.get("loss")
    return output if isinstance(output, torch.Tensor) else None


def _with_batch(part: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The step's arguments with the batch replaced by ``part``."""
    if args:
        return (part, *args[1:]), kwargs
    return (), {**kwargs, "batch": part}


class SplitStep:
    """The parts of one batch: ``training_step`` runs the first (:meth:`start`), ``backward`` the rest
    (:meth:`finish`)."""

    def __init__(self, strategy: Any, choice: AutoChoice, args: tuple, kwargs: dict) -> None:
        self.strategy, self.splits = strategy, choice.splits
        batch = args[0] if args else kwargs["batch"]
        self.parts = split(batch, choice.micro_batch)
        self.args, self.kwargs = args, kwargs

    def _step(self, part: Any) -> Any:
        args, kwargs = _with_batch(part, self.args, self.kwargs)
        return self.strategy._call_module("training_step", args, kwargs)

    def start(self) -> Any:
        """The first part's ``training_step`` that returns a loss (its output); the parts after it wait for
        ``backward``. A part whose step returns None is skipped, as a skipped micro-batch."""
        while self.parts:
            output = self._step(self.parts.pop(0))
            if _loss(output) is not None:
                return output
        return None

    def finish(self, closure_loss: torch.Tensor, backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Backward of the first part (``closure_loss``: its loss as Lightning divided it), then each further part's
        step and backward; the last part's backward is the step's final one."""
        strategy = self.strategy
        module = strategy.lightning_module
        accumulate = module.trainer.accumulate_grad_batches
        with self._non_final(last=not self.parts):
            result = backward(closure_loss / self.splits)
        while self.parts:
            part = self.parts.pop(0)
            previous, module._current_fx_name = module._current_fx_name, "training_step"  # `self.log` is allowed
            try:
                with strategy.precision_plugin.train_step_context():
                    loss = _loss(self._step(part))
            finally:
                module._current_fx_name = previous
            if loss is None:
                continue
            with self._non_final(last=not self.parts):
                result = backward(loss / (self.splits * accumulate))
        return result

    def _non_final(self, last: bool) -> contextlib.AbstractContextManager:
        """No gradient communication for a part before the last (unless Lightning's window is already quiet)."""
        if last or self.strategy._accumulating:
            return contextlib.nullcontext()
        return self.strategy.block_backward_sync()
