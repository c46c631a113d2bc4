"""A LightningModule cut into pipeline stages: the layers this rank holds, the process groups it talks
over, and one training or evaluation step of the schedule in Lightning's terms.

The LightningModule names its pipeline with two methods, and may refine it with two more::

    def pipeline_layers(self) -> Sequence[nn.Module]:  # the model as a chain: each layer's output feeds the next
        return [self.embedding, *self.blocks, self.head]

    def pipeline_loss(self, output, target) -> Tensor:  # the mean loss from the last layer's output
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def pipeline_batch(self, batch) -> tuple[Tensor, Tensor]:  # optional: default, the batch is (inputs, target)
    def log_pipeline_loss(self, split, loss) -> None:  # optional: default, self.log(f"{split}_loss", loss)

Its ``training_step``/``validation_step`` stay what a run without pipelining uses; with pipeline stages the
strategy runs the schedule in their place and hands the batch's mean loss, the same on every rank of a
pipeline, to ``log_pipeline_loss`` and to Lightning as the step's output.

[Note: layers of other stages live on the meta device]
Every rank builds the whole model (same seed, same initial weights), then moves the layers of the stages it
does not run to the meta device: their memory is freed while every parameter keeps its name and shape in
the module (as a new meta ``Parameter``: references taken before ``fit`` go stale, and the optimizer, built
afterwards, holds the meta ones). Which tensors those are is recorded once, as :attr:`PipelineParallel.holding`
(``engine/api.py: Holding``), and handed to the engine (which skips them: another stage steps them), the
checkpoint code (which writes only held tensors and checks names against the whole model, so a pipelined
checkpoint holds every parameter once under the unsplit names) and the precision plugin.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from torch import Tensor, nn

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.engine.api import Holding, PipelineStages, ShardingEngine
from lightning_zero.engine.comm import collectives, topology
from lightning_zero.pipeline.schedule import PipelineRunner, StageModules
from lightning_zero.pipeline.split import pipeline_layout, split_bounds

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

REQUIRED_HOOKS = ("pipeline_layers", "pipeline_loss")

#: Each LightningModule's stage modules from its last run, which a later run of the same cut takes over.
_BUILT: weakref.WeakKeyDictionary[nn.Module, StageModules] = weakref.WeakKeyDictionary()


def pipeline_layers_of(module: nn.Module) -> Sequence[nn.Module]:
    """The module's ``pipeline_layers()``, checked to be a non-empty sequence of modules (an ``nn.Sequential``
    is returned as it is: split points may name its children)."""
    missing = [hook for hook in REQUIRED_HOOKS if not callable(getattr(module, hook, None))]
    if missing:
        raise ZeroConfigError(
            f"`pipeline_stages > 1` needs {type(module).__name__} to define {' and '.join(f'`{m}`' for m in missing)}: "
            "`pipeline_layers()` returns the model as a sequence of layers (each one's output is the next one's "
            "input) and `pipeline_loss(output, target)` the loss from the last layer's output. See docs/pipeline.md."
        )
    layers = getattr(module, "pipeline_layers")()  # a hook of the user's class, checked above
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise ZeroConfigError(
            f"`{type(module).__name__}.pipeline_layers()` returned one {type(layers).__name__}; return a list, "
            "nn.Sequential or nn.ModuleList of the layers, in order."
        )
    if not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        layers = list(layers)
    if not len(layers) or not all(isinstance(layer, nn.Module) for layer in layers):
        raise ZeroConfigError(
            f"`{type(module).__name__}.pipeline_layers()` must return a non-empty sequence of nn.Modules."
        )
    return layers


def _check_ownership(module: nn.Module, layers: Sequence[nn.Module], bounds: Sequence[int]) -> None:
    """Each trainable parameter in exactly one stage, none outside the layers: otherwise two stages would
    update one tensor separately, or nobody would update it."""
    names = {id(p): n for n, p in module.named_parameters()}
    stage_of: dict[int, int] = {}
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s] : bounds[s + 1]]:
            for p in layer.parameters():
                if stage_of.setdefault(id(p), s) != s:
                    raise ZeroConfigError(
                        f"Parameter {names.get(id(p), tuple(p.shape))!r} is used by pipeline stages {stage_of[id(p)]} "
                        f"and {s} (e.g. tied embeddings); a parameter must live in one stage. Untie it, or cut so "
                        "that its layers share a stage (`pipeline_split`)."
                    )
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in stage_of]
    if outside:
        raise ZeroConfigError(
            f"Trainable parameters {outside[:5]}{' ...' if len(outside) > 5 else ''} are in no layer of "
            f"`{type(module).__name__}.pipeline_layers()`, so no stage would train them: add their modules to the "
            "layers or freeze them."
        )


def _holding(module: nn.Module, others: Sequence[nn.Module]) -> Holding:
    """The names (every alias) of the parameters and buffers of the layers of other stages."""
    names: dict[int, list[str]] = {}
    for name, tensor in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        names.setdefault(id(tensor), []).append(name)
    tensors = {id(t): t for layer in others for t in (*layer.parameters(), *layer.buffers())}
    return Holding(frozenset(name for key in tensors for name in names.get(key, ())))


class PipelineParallel:
    """This rank's stages of a LightningModule and the groups it runs them over.

    Ranks form ``replicas x ranks_per_pipeline`` (see :class:`PipelineLayout`): ``pp_group`` carries the
    activations of one pipeline, ``dp_group`` (the ranks holding the same stages) is where ZeRO shards them.
    """

    def __init__(self, module: nn.Module, config: ZeroConfig, rank: int, world_size: int, device: torch.device) -> None:
        if not getattr(module, "automatic_optimization", True):
            raise ZeroConfigError(
                "`pipeline_stages > 1` needs automatic optimization: the schedule runs forward and backward in place of "
                "`training_step`, so `manual_backward` and your own `optimizer.step()` would never run. Set "
                "`self.automatic_optimization = True` or train without pipelining."
            )
        self.layout = pipeline_layout(config, world_size)
        chain = pipeline_layers_of(module)
        bounds = split_bounds(chain, self.layout.num_stages, config.pipeline_split)
        layers = list(chain)
        _check_ownership(module, layers, bounds)
        self.bounds = bounds
        self.device = device
        mine = set(self.layout.stages_of(rank))
        others = [
            layer for s in range(self.layout.num_stages) if s not in mine for layer in layers[bounds[s] : bounds[s + 1]]
        ]
        #: What this rank holds, handed to the engine, checkpoints and precision (see ``engine/api.py: Holding``).
        self.holding = _holding(module, others)
        with torch.no_grad():
            for layer in others:
                layer.to("meta")  # see [Note: layers of other stages live on the meta device]
            module._apply(lambda t: t if t.is_meta else t.to(device))
        _update_properties(module, device=device)  # what `module.to(device)` would record (`self.device`)
        #: ("dp", "pp"): row r is replica r's pipeline, column s the data-parallel group of pipeline rank s.
        self.mesh = topology.device_mesh(
            device.type, (self.layout.replicas, self.layout.ranks_per_pipeline), ("dp", "pp")
        )
        self.dp_mesh = self.mesh["dp"]
        self.dp_group = self.mesh.get_group("dp")
        self.pp_group = self.mesh.get_group("pp")
        #: Global ranks: the first of this rank's data-parallel group, the holder of this pipeline's last stage.
        self.dp_source = self.layout.data_parallel_group(rank)[0]
        self.last_stage_rank = self.layout.pipeline_group(rank)[self.layout.rank_of_stage(self.layout.num_stages - 1)]
        self.module = module
        self.runner = PipelineRunner(
            layers,
            bounds,
            self.layout,
            rank,
            device,
            config.pipeline_microbatches,
            config.pipeline_schedule,
            getattr(module, "pipeline_loss"),
            group=self.pp_group,
            previous=_BUILT.get(module),
        )
        _BUILT[module] = self.runner.built  # see [Note: a later run keeps the stage modules] in ``schedule.py``
        self._stash: list[tuple[Tensor, Tensor]] = []

    @property
    def stages(self) -> PipelineStages:
        """This rank's stage modules, as stage 3 shards them over their data-parallel ranks."""
        return PipelineStages(tuple(self.runner.modules), tuple(self.runner.stage_ids), self.dp_mesh, self.holding)

    # ------------------------------------------------------------------ data
    def sampler_kwargs(self, rank: int) -> dict[str, int]:
        """The ranks of one pipeline read the same batches (the first stage its inputs, the last its targets)."""
        return {"num_replicas": self.layout.replicas, "rank": self.layout.replica(rank)}

    def _split(self, batch: Any) -> tuple[Tensor, Tensor]:
        hook = getattr(self.module, "pipeline_batch", None)
        if callable(hook):
            return hook(batch)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        raise ZeroConfigError(
            f"The pipeline needs each batch as (inputs, target); got a {type(batch).__name__}. Define "
            f"`{type(self.module).__name__}.pipeline_batch(batch)` returning (inputs, target)."
        )

    # ------------------------------------------------------------------ steps
    def _share(self, loss: Tensor | None) -> Tensor:
        """The last stage's loss on every rank of the pipeline."""
        out = loss.detach().float().reshape(()) if loss is not None else torch.zeros((), device=self.device)
        collectives.broadcast([out], src=self.last_stage_rank, group=self.pp_group)
        return out

    def training_step(self, batch: Any, factor: float, engine: ShardingEngine | None = None) -> Tensor:
        """:meth:`train_step`, and the loss logged. Stages 1-2 hold the engine's gradient reduction back (it runs
        once, after the last micro-batch, when the strategy's ``backward`` flushes it); stage 3 reduces inside
        the schedule's last backward when the engine synchronises (see [Note: stage 3 under pipeline stages])."""
        if engine is not None and engine.gathered_units is not None:
            self.runner.reduce_gradients = engine.synchronizing
            loss = self.train_step(batch, factor, engine)
        else:
            with engine.no_sync() if engine is not None else contextlib.nullcontext():
                loss = self.train_step(batch, factor, engine)
        self.log_loss("train", loss)
        return loss

    def evaluation_step(self, split: str, batch: Any) -> Tensor:
        """Forward and loss only (validation, test); the batch's mean loss on every rank, logged."""
        inputs, target = self._split(batch)
        loss = self._share(self.runner.evaluate(inputs, target))
        self.log_loss(split, loss)
        return loss

    def train_step(self, batch: Any, factor: float, engine: ShardingEngine | None = None) -> Tensor:
        """Forward, loss and backward of one batch over the micro-batches; its mean loss, on every rank.

        The schedule's gradients (of ``factor x`` the loss) are held aside until :meth:`restore_gradients`, and
        whatever the parameters held before is put back meanwhile: Lightning zeroes gradients between
        ``training_step`` and ``backward`` at the start of an accumulation window, and the pipeline has already
        run its backward by then. Those are the gradients of the parameters the optimizer holds (the engine's
        records: at stage 3 the sharded parameters, not the gathered ones the stages compute with, and FSDP2 adds
        its reduction to what they hold, so they must hold nothing during the schedule, and the engine settles which
        of them keep a gradient before what they held comes back)."""
        inputs, target = self._split(batch)
        params = [record.param for record in engine.records()] if engine is not None else list(self.runner.parameters())
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self.runner.step(inputs, target, factor)
        if engine is not None and engine.gathered_units is not None and self.runner.reduce_gradients:
            engine.gathered_units.land_gradients()  # while the parameters hold this schedule's gradients only
        for p, held in zip(params, before):
            if p.grad is not None:
                self._stash.append((p, p.grad))
            p.grad = held
        return self._share(loss)

    def restore_gradients(self) -> None:
        """Give the parameters the gradients of the last :meth:`train_step`, added to what they hold."""
        with torch.no_grad():
            for p, grad in self._stash:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        self._stash = []

    def log_loss(self, split: str, loss: Tensor) -> None:
        hook = getattr(self.module, "log_pipeline_loss", None)
        if callable(hook):
            hook(split, loss)
        else:
            cast("LightningModule", self.module).log(f"{split}_loss", loss, prog_bar=True, sync_dist=split != "train")
