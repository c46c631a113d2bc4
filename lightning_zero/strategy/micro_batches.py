"""One training step over several micro-batches: ``stage="auto"`` chose a micro-batch smaller than the batch the
DataLoader gives, so the strategy splits each batch and accumulates over its parts inside the step.

[Note: a batch's parts in Lightning's order]
Lightning's automatic optimization runs ``training_step``, then ``zero_grad`` (at a window's first batch), then
``backward``. So ``training_step`` runs the first part's step only and returns its output; ``backward`` runs that
part's backward, then each further part's ``training_step`` and backward. Every part but the last is a non-final
micro-batch (no gradient communication), and each part's loss is divided once, by the number of splits times
``accumulate_grad_batches`` (the hand-written configuration's ``accumulate_grad_batches``). That is the hand-written configuration's step (the DataLoader's batch
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

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.planning.auto import AutoChoice, splittable
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
        if not splittable(batch):
            raise ZeroConfigError(
                "`stage='auto'` chose to split each batch into micro-batches of "
                f"{choice.micro_batch}, and this batch is not a tensor, or a dict, list or tuple of tensors sharing "
                "their first dimension. Keep the batches of the fit the choice was made for, or name a stage."
            )
        self.parts = split(batch, choice.micro_batch)
        if len(self.parts) > self.splits:
            raise ZeroConfigError(
                f"`stage='auto'` chose micro-batches of {choice.micro_batch} for batches of {choice.batch} samples "
                f"a rank, and this batch holds {tree_leaves(batch)[0].shape[0]}: its {len(self.parts)} parts would "
                f"weigh more than one batch (and need memory the choice did not plan). Keep the batch size the choice "
                "was made for, or name a stage."
            )
        self.args, self.kwargs = args, kwargs
        self.first_loss: torch.Tensor | None = None

    def _step(self, part: Any) -> tuple[Any, torch.Tensor]:
        """The part's ``training_step``: its output and its loss."""
        args, kwargs = _with_batch(part, self.args, self.kwargs)
        output = self.strategy._call_module("training_step", args, kwargs)
        loss = _loss(output)
        if loss is None:  # as Lightning refuses a skipped step on several ranks: the ranks' parts must agree
            raise RuntimeError(
                "`training_step` returned no loss for a part of a batch that `stage='auto'` split into "
                "micro-batches; skipping part of a step is not supported (the ranks would disagree on which "
                "backward reduces). Return a loss for every batch, or name a stage."
            )
        return output, loss

    def start(self) -> Any:
        """The first part's ``training_step`` (its output); the parts after it wait for ``backward``."""
        output, self.first_loss = self._step(self.parts.pop(0))
        return output

    def finish(self, backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Backward of the first part, then each further part's step and backward; the last part's backward is the
        step's final one. Each part's loss is divided once, by the splits times ``accumulate_grad_batches`` (as the
        hand-written configuration divides it by its ``accumulate_grad_batches``, not in two roundings)."""
        strategy = self.strategy
        module = strategy.lightning_module
        scale = self.splits * module.trainer.accumulate_grad_batches
        first = self.first_loss
        if first is None:
            raise RuntimeError("lightning_zero internal error: a split step's backward before its first part")
        with self._non_final(last=not self.parts):
            result = backward(first / scale)
        while self.parts:
            part = self.parts.pop(0)
            previous, module._current_fx_name = module._current_fx_name, "training_step"  # `self.log` is allowed
            try:
                with strategy.precision_plugin.train_step_context():
                    _, loss = self._step(part)
            finally:
                module._current_fx_name = previous
            with self._non_final(last=not self.parts):
                result = backward(loss / scale)
        return result

    def _non_final(self, last: bool) -> contextlib.AbstractContextManager:
        """No gradient communication for a part before the last (unless Lightning's window is already quiet)."""
        if last or self.strategy._accumulating:
            return contextlib.nullcontext()
        return self.strategy.block_backward_sync()
