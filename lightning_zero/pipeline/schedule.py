"""One pipeline's stages on this rank and the ``torch.distributed.pipelining`` schedule that drives them.

The layers a rank runs stay the model's own module objects (wrapped in an ``nn.Sequential`` per stage), so
parameter identity, and with it the unsplit model's parameter names, survives the cut. ``step`` runs the
schedule's forward, loss and backward over the micro-batches and returns the mean micro-batch loss on the
last stage.

[Note: the gradient is that of the mean loss, times a factor the caller chooses]
The schedule runs with ``scale_grads=False`` and the loss it back-propagates is each micro-batch's loss times
``factor / m``: the gradients then equal those of ``factor x`` the mean micro-batch loss, which is the
batch loss an unsplit run computes (for a mean-reduced loss and equal micro-batches). torch's own
``scale_grads=True`` divides ``p.grad`` after the step instead, which would also divide gradients held
from earlier batches of a gradient-accumulation window. ``factor`` carries the accumulation's ``1/k`` and a
``16-mixed`` loss scale.

[Note: one schedule per micro-batch shape]
A schedule infers the shapes of the activations it sends on its first step and keeps receive buffers of
those shapes. A batch of another shape (a last partial batch), or a switch between training and
evaluation, therefore gets a fresh schedule over the same stages; every rank of a pipeline sees the same
batch, so all rebuild together.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.utils.hooks import RemovableHandle

from lightning_zero.config.choices import ZeroConfigError, check_choice
from lightning_zero.config.zero_config import LOOPED_SCHEDULES, V_SCHEDULES
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.stage3.fsdp2_private import reshard_all
from lightning_zero.pipeline.split import PipelineLayout
from lightning_zero.torch_versions.pipelining import (
    Action,
    ComputationType,
    PipelineStageWithoutSelfExchange,
    add_send_recv,
    add_unshard_reshard,
)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


class ShardedStage(PipelineStageWithoutSelfExchange):
    """A pipeline stage whose FSDP2-sharded module reduces its gradients only when asked.

    [Note: stage 3 under pipeline stages]
    Each stage module is an FSDP2 root over the stage's data-parallel ranks. ``torch.distributed.pipelining``
    drives FSDP2 itself: every backward of a step runs with gradient sync off and without resharding (the
    stage's gradients accumulate unsharded over the micro-batches), and after the step's last backward the
    schedule runs FSDP2's post-backward on every unit, which reduce-scatters the sums and reshards. A batch that
    is not the last of a gradient-accumulation window skips that reduction (``reduce_gradients`` False): the
    unsharded sums carry over to the next batch, and the window's last batch reduces them all, once, so a
    window sends its gradients once, as without pipelining.

    Units are sharded with ``reshard_after_forward=False``: gathered at a step's first forward, they stay
    gathered over its micro-batches (torchtitan's choice under pipelining; the schedules with an action list
    gather and reshard each stage themselves). Resharding after every forward was measured and dropped: the
    backwards keep the units gathered until the step's reduction anyway, so the peak was the same whole stage
    at 4-5x the all-gathered elements per batch (1F1B, 4 micro-batches), and a weight gradient computed after
    its unit was resharded (the zero-bubble schedules) read freed parameters.
    """

    reduce_gradients = True

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.reduce_gradients or not isinstance(self.submod, FSDPModule):
            super().perform_reduce_grad(grad_scale_factor)


@dataclasses.dataclass
class StageModules:
    """This rank's stage modules of one cut, and the hooks the runner that built them put on them.

    [Note: a later run keeps the stage modules]
    Stage 3 makes each stage module an FSDP2 root over units that FSDP2 initialises once, under that root: a
    new ``nn.Sequential`` around the same units in a later ``validate``, ``test`` or ``fit`` of the module
    would be a second root, which FSDP2 refuses at its first forward. The stage modules therefore outlive
    the run that built them, as the sharded LightningModule itself does without pipeline stages; they hold
    no reference to the LightningModule, so they live no longer than it does."""

    stage_ids: list[int]
    modules: list[nn.Sequential]
    observers: list[RemovableHandle]

    def take(self, stage_ids: Sequence[int], chains: Sequence[Sequence[nn.Module]]) -> list[nn.Sequential] | None:
        """The modules, with this runner's hooks removed, for a run of the same cut (the same stages of the same
        layers); None for another cut."""
        same = list(stage_ids) == self.stage_ids and all(
            len(module) == len(chain) and all(a is b for a, b in zip(module, chain))
            for module, chain in zip(self.modules, chains)
        )
        if not same:
            return None
        for handle in self.observers:
            handle.remove()
        return list(self.modules)


def _call_weakly(method: weakref.WeakMethod, *args) -> None:
    bound = method()
    if bound is not None:
        bound(*args)


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
        previous: StageModules | None = None,
    ) -> None:
        check_choice("pipeline_schedule", schedule, SCHEDULES)
        multi = schedule in (*LOOPED_SCHEDULES, *V_SCHEDULES)
        if multi != (layout.virtual > 1) or layout.v_shape != (schedule in V_SCHEDULES):
            raise ZeroConfigError(
                f"`pipeline_schedule={schedule!r}` with {layout.virtual} stage(s) per rank"
                f"{' in a V' if layout.v_shape else ''}: {', '.join(LOOPED_SCHEDULES)} run several looped stages per "
                f"rank, {', '.join(V_SCHEDULES)} two in a V, gpipe and 1f1b exactly one."
            )
        if microbatches < 1:
            raise ZeroConfigError(f"`microbatches` must be >= 1, got {microbatches}.")
        if len(bounds) != layout.num_stages + 1:
            raise ZeroConfigError(f"{len(bounds) - 1} stage bounds for a layout of {layout.num_stages} stages.")
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.schedule_class = SCHEDULES[schedule]
        self.multi = multi
        self.stage_ids = layout.stages_of(layout.pipeline_rank(rank))
        chains = [list(layers[bounds[s] : bounds[s + 1]]) for s in self.stage_ids]
        reused = previous.take(self.stage_ids, chains) if previous is not None else None
        self.modules = reused or [nn.Sequential(*chain) for chain in chains]
        self.stages = [
            ShardedStage(module, s, layout.num_stages, device, group=group)
            for module, s in zip(self.modules, self.stage_ids)
        ]
        self.num_stages = layout.num_stages
        self.layout = layout
        self._boundary: dict[int, tuple[Tensor | None, Tensor | None]] = {}
        observe = weakref.WeakMethod(self._observe)  # the modules may outlive this runner (``StageModules``)
        #: The stage modules, for a later run of the same cut.
        hooks = [
            module.register_forward_hook(functools.partial(_call_weakly, observe, s))
            for module, s in zip(self.modules, self.stage_ids)
        ]
        self.built = StageModules(list(self.stage_ids), list(self.modules), hooks)
        self.schedule = None
        self._shape_key: tuple | None = None
        self._factor = 1.0
        self._training = True
        self._losses: list[Tensor] = []
        self.is_first = 0 in self.stage_ids
        self.is_last = layout.num_stages - 1 in self.stage_ids

    def _observe(self, stage: int, module: nn.Module, inputs: tuple, output: Tensor) -> None:
        """Remember one micro-batch's input and output of ``stage`` (shape and dtype only), for :meth:`_count_sends`."""
        received = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        self._boundary[stage] = (_meta_like(received), _meta_like(output))

    def _count_sends(self, train: bool) -> None:
        """[Note: pipeline traffic is counted where it is produced]
        ``torch.distributed.pipelining`` sends activations and their gradients itself, past ``collectives.py``.
        After each step this rank counts what its stages sent, as ``"send"`` in ``comm_stats()``: per micro-batch,
        stage ``s``'s output to stage ``s + 1`` and, when training, the gradient of its input (the same size) to
        stage ``s - 1``, unless that stage runs on this rank too (the turn of a V). The sizes come from the step's
        own forwards; a new schedule's shape inference, which exchanges only metadata, is not counted."""
        elsewhere = self._on_another_rank
        for stage in self.stage_ids:
            received, output = self._boundary.get(stage, (None, None))
            for tensor, sent in (
                (output, elsewhere(stage, stage + 1)),
                (received, train and elsewhere(stage, stage - 1)),
            ):
                if sent and tensor is not None:
                    for _ in range(self.microbatches):
                        collectives.record_sent(tensor)

    def _on_another_rank(self, stage: int, neighbour: int) -> bool:
        """Whether ``neighbour`` exists and runs on another rank than ``stage`` (a V's middle stages share one)."""
        rank_of = self.layout.rank_of_stage
        return 0 <= neighbour < self.num_stages and rank_of(neighbour) != rank_of(stage)

    @property
    def reduce_gradients(self) -> bool:
        """Whether the next step's last backward reduces FSDP2 stages' gradients (see [Note: stage 3 under
        pipeline stages]); stages 1-2 reduce after the schedule, in the engine."""
        return all(stage.reduce_gradients for stage in self.stages)

    @reduce_gradients.setter
    def reduce_gradients(self, reduce: bool) -> None:
        for stage in self.stages:
            stage.reduce_gradients = reduce

    def reshard(self) -> None:
        """Free the gathered parameters of FSDP2-sharded stages (after evaluation, which never reshards them when
        a stage keeps them gathered over a step)."""
        for module in self.modules:
            reshard_all(module)

    def _scaled_loss(self, output: Tensor, target: Tensor) -> Tensor:
        loss = self.loss_fn(output, target)
        self._losses.append(loss.detach())
        return loss * (self._factor / self.microbatches)

    def _forward_only(self, schedule) -> None:
        """[Note: evaluating a V]
        torch 2.13's V-shaped schedules (ZBV, DualPipeV) run their training action lists in ``eval()`` too, and
        fail at the turn of the V, where a backward hands its input gradient to the rank's other stage. Their
        evaluation therefore runs a forward-only action list: every rank runs its first stage for every
        micro-batch, then its second (each depends only on the neighbour's same pass, so nothing waits in a
        cycle), lowered to FSDP2 gathers, sends and receives by torch's own passes. ``_Action``, those passes and
        the schedule's ``pipeline_order_with_comms`` are private pieces of ``torch.distributed.pipelining``
        (``torch_versions/pipelining.py``; its public loader insists on a backward for every forward)."""
        order = {
            rank: add_unshard_reshard(
                [
                    Action(stage, ComputationType.FORWARD, mb)
                    for stage in self.layout.stages_of(rank)
                    for mb in range(self.microbatches)
                ]
            )
            for rank in range(self.layout.ranks_per_pipeline)
        }
        schedule.pipeline_order_with_comms = add_send_recv(
            order, stage_to_rank=self.layout.rank_of_stage, num_stages=self.num_stages
        )

    def _schedule_for(self, inputs: Tensor | None, target: Tensor | None):
        # Training and evaluation never share one: evaluation may run in inference mode (Lightning's default
        # on CUDA), which would make the reused receive buffers inference tensors that backward cannot use.
        key = (self._training, *((tuple(t.shape), t.dtype) if t is not None else None for t in (inputs, target)))
        if self.schedule is None or key != self._shape_key:
            stages = self.stages if self.multi else self.stages[0]
            self.schedule = self.schedule_class(
                stages, n_microbatches=self.microbatches, loss_fn=self._scaled_loss, scale_grads=False
            )
            if self.layout.v_shape and not self._training:
                self._forward_only(self.schedule)
            self._shape_key = key
        return self.schedule

    def _run(self, inputs: Tensor | None, target: Tensor | None, factor: float, train: bool) -> Tensor | None:
        self._check_divisible(inputs, target)
        self._training = train
        schedule = self._schedule_for(inputs, target)
        self._factor, self._losses = factor, []
        args = (inputs,) if self.is_first else ()
        kwargs = {"target": target} if self.is_last else {}
        if train:
            schedule.step(*args, **kwargs, return_outputs=False)  # the losses are all we need from the last stage
        else:
            with torch.no_grad():
                schedule.eval(*args, **kwargs, return_outputs=False)
            self.reshard()
        self._count_sends(train)
        for stage in self.stages:  # the schedule keeps the step's outputs (the last stage's logits) until the next
            stage.clear_runtime_states()
        # The last m: a fresh schedule first calls the loss once on placeholder outputs to infer shapes.
        losses, self._losses = self._losses[-self.microbatches :], []
        return torch.stack(losses).mean() if self.is_last else None

    def parameters(self):
        for module in self.modules:
            yield from module.parameters()

    def _check_divisible(self, inputs: Tensor | None, target: Tensor | None) -> None:
        for name, tensor in (("inputs", inputs), ("target", target)):
            if tensor is not None and tensor.shape[0] % self.microbatches:
                raise ZeroConfigError(
                    f"`microbatches={self.microbatches}` does not divide the batch of {tensor.shape[0]} ({name}): "
                    "choose a divisor of the per-replica batch size (and `drop_last=True` if the last batch is short)."
                )

    def step(self, inputs: Tensor | None, target: Tensor | None, factor: float = 1.0) -> Tensor | None:
        """Forward, loss and backward over the micro-batches; the mean micro-batch loss on the last stage.
        Gradients are accumulated into ``p.grad`` as those of ``factor x`` that loss."""
        return self._run(inputs, target, factor, train=True)

    def evaluate(self, inputs: Tensor | None, target: Tensor | None) -> Tensor | None:
        """Forward and loss only (validation); the mean micro-batch loss on the last stage."""
        return self._run(inputs, target, 1.0, train=False)


def _meta_like(tensor: object) -> Tensor | None:
    """``tensor``'s shape and dtype without its memory; None for anything else (a stage may return a tuple)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") if isinstance(tensor, Tensor) else None
