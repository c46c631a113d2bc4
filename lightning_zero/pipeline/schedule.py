"""One pipeline's stages on this rank and the ``torch.distributed.pipelining`` schedule that drives them.

The layers a rank runs stay the model's own module objects (wrapped in an ``nn.Sequential`` per stage), so
parameter identity, and with it the unsplit model's parameter names, survives the cut. ``step`` runs the
schedule's forward, loss and backward over the micro-batches and returns the mean micro-batch loss on the
last stage: the schedule scales each micro-batch loss by 1/m, so the gradients equal those of the mean
loss over the whole batch, as an unsplit run computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_zero.config import ZeroConfigError, check_choice
from lightning_zero.pipeline.split import PipelineLayout

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class PipelineRunner:
    """This rank's stages of one pipeline (``layout.stages_of(rank)``) and their schedule."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        bounds: Sequence[int],
        layout: PipelineLayout,
        rank: int,
        device: torch.device,
        microbatches: int,
        schedule: str,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        group=None,
    ) -> None:
        check_choice("pipeline_schedule", schedule, SCHEDULES)
        interleaved = schedule == "interleaved_1f1b"
        if interleaved != (layout.virtual > 1):
            raise ZeroConfigError(
                f"`pipeline_schedule={schedule!r}` with {layout.virtual} stage(s) per rank: interleaved_1f1b runs "
                "several virtual stages per rank, gpipe and 1f1b exactly one."
            )
        if microbatches < 1:
            raise ZeroConfigError(f"`microbatches` must be >= 1, got {microbatches}.")
        if len(bounds) != layout.num_stages + 1:
            raise ZeroConfigError(f"{len(bounds) - 1} stage bounds for a layout of {layout.num_stages} stages.")
        self.microbatches = microbatches
        self.stage_ids = layout.stages_of(layout.pipeline_rank(rank))
        self.modules = [nn.Sequential(*layers[bounds[s] : bounds[s + 1]]) for s in self.stage_ids]
        self.stages = [
            PipelineStage(module, s, layout.num_stages, device, group=group) for module, s in zip(self.modules, self.stage_ids)
        ]
        stages = self.stages if interleaved else self.stages[0]
        self.schedule = SCHEDULES[schedule](stages, n_microbatches=microbatches, loss_fn=loss_fn)
        self.is_first = 0 in self.stage_ids
        self.is_last = layout.num_stages - 1 in self.stage_ids

    def parameters(self):
        for module in self.modules:
            yield from module.parameters()

    def _arguments(self, inputs: Tensor | None, target: Tensor | None, losses: list) -> tuple[tuple, dict]:
        for name, tensor in (("inputs", inputs if self.is_first else None), ("target", target if self.is_last else None)):
            if tensor is not None and tensor.shape[0] % self.microbatches:
                raise ZeroConfigError(
                    f"`microbatches={self.microbatches}` does not divide the batch of {tensor.shape[0]} ({name}); "
                    "choose a divisor of the per-replica batch size."
                )
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": target, "losses": losses} if self.is_last else {}
        return args, kwargs

    def step(self, inputs: Tensor | None, target: Tensor | None) -> Tensor | None:
        """Forward, loss and backward over the micro-batches; the mean micro-batch loss on the last stage."""
        losses: list[Tensor] = []
        args, kwargs = self._arguments(inputs, target, losses)
        self.schedule.step(*args, **kwargs)
        return torch.stack([loss.detach() for loss in losses]).mean() if self.is_last else None

    @torch.no_grad()
    def evaluate(self, inputs: Tensor | None, target: Tensor | None) -> Tensor | None:
        """Forward and loss only (validation); the mean micro-batch loss on the last stage."""
        losses: list[Tensor] = []
        args, kwargs = self._arguments(inputs, target, losses)
        self.schedule.eval(*args, **kwargs)
        return torch.stack([loss.detach() for loss in losses]).mean() if self.is_last else None
