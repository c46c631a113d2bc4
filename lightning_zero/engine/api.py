"""The contract between the layers above (strategy, precision, checkpoints, memory accounting, monitor) and the
two sharding engines: :class:`~lightning_zero.engine.stage12.zero_dp.ZeroDataParallel` (stages 1-2, our own) and
:class:`~lightning_zero.engine.stage3.fsdp2.FullyShardedEngine` (stage 3, over FSDP2).

Callers see three things and nothing else:

* :class:`ShardingEngine`: the module-level calls (backward hooks, accumulation, checkpoint hand-over,
  teardown) and the facts a caller may branch on (``holds_masters``, ``optimizer_on_host``), with what only one
  engine has behind a capability that is None on the other: :class:`GatheredUnits` (stage 3's parameters,
  gathered per unit for compute) and :class:`DelayedUpdate` (stages 1-2 under ``offload_step_delay``);
* :class:`OptimizerShards`: one per optimizer, what precision and clipping need (finalize/unscale, gradient
  shards, the step, skipping a step) and what checkpoints need (which tensor holds each parameter's state, and
  which rank alone holds it for parameters stepped whole);
* :class:`ShardRecord`: one per trainable parameter this rank holds, with the name, full shape, this rank's
  rows and gradient rows, and the ranks the rows are spread over. Checkpoints, accounting and the monitor
  read these instead of reaching into engine internals;
* :class:`Holding`: which of the module's tensors live on this rank at all (pipeline stages hold different
  layers), handed by the pipeline to the engine and to whatever walks the module;
* :class:`PipelineStages`: the modules of this rank's pipeline stages, which stage 3 shards as its roots.

Which engine serves a run is decided once, in the strategy (``stage``); nothing after that asks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_zero.engine.comm.compression import CompressedComm

V = TypeVar("V")


@dataclass(frozen=True)
class Holding:
    """The module's parameters and buffers, by ``state_dict`` name, that this rank does not hold.

    Under pipeline stages every rank builds the whole model, then frees the layers of the stages it does not run
    (``pipeline/parallel.py``); their tensors keep their names and shapes in the module, so checkpoints can check
    names and shapes against the whole model. Which tensors those are is decided there, once, and handed to the
    engine, the checkpoint code and precision as this record, so none of them guesses it from where a tensor
    happens to live. Without pipeline stages a rank holds everything (``Holding()``).
    """

    elsewhere: frozenset[str] = frozenset()

    def holds(self, name: str) -> bool:
        return name not in self.elsewhere

    @property
    def everything(self) -> bool:
        return not self.elsewhere

    def held(self, named: Mapping[str, V] | Iterable[tuple[str, V]]) -> dict[str, V]:
        """The ``(name, value)`` pairs of ``named`` (a ``state_dict`` or ``named_parameters``) this rank holds."""
        items = named.items() if isinstance(named, Mapping) else named
        return {name: value for name, value in items if name not in self.elsewhere}


@dataclass(frozen=True)
class PipelineStages:
    """This rank's pipeline stages as stage 3 shards them: each stage module becomes an FSDP2 root over the
    stage's data-parallel ranks (``mesh``), its layers units inside it, and the pipeline schedule, not the
    LightningModule's ``__call__``, runs their forwards and backwards."""

    modules: tuple[nn.Module, ...]
    """One module per stage this rank runs, holding that stage's layers (the model's own module objects)."""
    indices: tuple[int, ...]
    """The stage index of each module."""
    mesh: DeviceMesh
    """The ranks holding the same stages, one per pipeline replica: each stage's rows are spread over these."""
    holding: Holding
    """What this rank holds of the module (its stages' layers)."""


@dataclass(frozen=True)
class ShardRecord:
    """One trainable parameter as this rank holds it.

    ``rows`` and ``grad`` are read when asked: the rows a checkpoint reads or writes are the optimizer's
    (fp32 masters under mixed precision, a host copy under offload, else a view of the resident parameter), and
    the gradient rows change every step.
    """

    name: str
    param: torch.Tensor
    """The module's parameter object (a resident tensor at stages 1-2, a DTensor at stage 3)."""
    shape: torch.Size
    """The full, unsharded shape."""
    group: dist.ProcessGroup | None
    """The ranks this parameter's rows are spread over (None: every rank)."""
    _rows: Callable[[], torch.Tensor]
    _grad: Callable[[], torch.Tensor | None]

    @property
    def rows(self) -> torch.Tensor:
        """This rank's rows as the optimizer updates them (dim-0 chunk ``rank`` of ``shape``, unpadded)."""
        return self._rows()

    @property
    def grad(self) -> torch.Tensor | None:
        """This rank's gradient rows, or None before a backward has produced them."""
        return self._grad()


@runtime_checkable
class OptimizerShards(Protocol):
    """The user's optimizer as the engine steps it: only this rank's shards."""

    def finalize_gradients(self, scale: float = 1.0) -> None:
        """Average the reduced gradient shards over ranks and multiply by ``scale`` (loss unscaling), once
        per step, before clipping or the overflow check read them."""

    def local_gradients(self, for_change: bool = False) -> list[torch.Tensor]:
        """This rank's gradient shards, disjoint from every other rank's (for norms and clipping). ``for_change``:
        the caller is about to change them (clipping); an engine whose host already stepped some of them during
        backward refuses, naming the fix."""

    def step(self, **kwargs: Any) -> object:
        """Step the optimizer on this rank's shards and bring the updated parameters where forward needs them."""

    def discard_gradients(self) -> None:
        """A skipped step: drop the gradients as a step would have consumed them."""

    def settle(self) -> None:
        """Wait for the host steps running in the worker thread (parts started during backward, a delayed update),
        which write the masters and create the optimizer's state, before a caller reads either."""

    def hosted(self) -> dict[int, torch.Tensor]:
        """``id(param)`` -> the tensor the optimizer keys that parameter's state by, where it is not the
        parameter itself (a shard view, a master, a host copy). Checkpoints translate state through this."""

    def hosting(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the optimizer holds those tensors in place of the parameters (loading its state)."""

    def speculated_norms(self) -> dict[int, torch.Tensor] | None:
        """Where parts of the step ran during backward before the clipping coefficient was known (see
        [Note: speculative clipping] in ``offload/speculation.py``): ``id(gradient)`` -> the 2-norm of each gradient
        they read that the clip reads too (stages 1-2; empty where the clip reads other tensors), for the global norm;
        else None."""

    def undo_speculation(self) -> None:
        """The clip fired (or another change of the gradients comes): put the parts stepped speculatively back, to be
        stepped again with the changed gradients."""

    def state_loaded(self) -> None:
        """A checkpoint wrote the optimizer's state (in the dtype it was saved in): hold it in this run's
        ``optimizer_state_dtype``."""

    def records(self) -> list[ShardRecord]:
        """The :class:`ShardRecord` of each trainable parameter this optimizer steps, in ``param_groups`` order."""

    def owners_of(self) -> dict[int, int] | None:
        """``id(param)`` -> the rank (in :attr:`ShardingEngine.group`) that steps it whole and alone holds its
        optimizer state, for matrix optimizers (``owner_step.py``); shard-stepped parameters are not listed. None
        for element-wise optimizers (the same on every rank: it decides collectives). Checkpoints save and load
        such state whole, on that rank."""


@runtime_checkable
class GatheredUnits(Protocol):
    """An engine whose parameters are DTensor shards, gathered a unit at a time for compute (stage 3): what a caller
    that reads parameters outside forward, compiles blocks or runs its own schedule must ask of it. Where every
    rank holds every parameter whole and the optimizer steps views of its rows (stages 1-2) there is none."""

    @property
    def units(self) -> list[torch.nn.Module]:
        """The blocks the engine divided the module into (one ``fully_shard`` each), which compiling must follow."""

    @property
    def shards_module_in_place(self) -> bool:
        """The engine converted the module in place (FSDP2's ``fully_shard``): steps go through the module's
        ``__call__`` so the engine's hooks run, and its layers cannot be swapped back afterwards."""

    @property
    def params_on_host(self) -> bool:
        """``offload_params``: parameter shards and their gradients live in host memory."""

    def land_gradients(self) -> None:
        """Land the reductions of the backward that just ran and settle which parameters hold a gradient (the zero
        gradients of parameters no rank used go back to None), for a caller that sets the parameters' earlier
        gradients aside around a backward and must do this before it puts them back (pipeline stages)."""

    def reshard(self) -> None:
        """Parameters back to their shards now, where an accumulation window kept them gathered, before anything
        reads the module as sharded: an evaluation loop, a checkpoint, the end of training."""

    def hold_root_gathered(self) -> Callable[[], None]:
        """A step method (``training_step``, ...) begins inside the root module's forward: keep the parameters it
        holds outside every unit whole across a nested forward of the root (``self(x)`` in the method), so code after
        it may use them. Returns what lets the root's outer post-forward reshard them as before."""


@runtime_checkable
class DelayedUpdate(Protocol):
    """``offload_step_delay=1`` (stages 1-2): the parameters forward computes with lag the optimizer's rows by one
    update (see [Note: the delayed update] in ``offload/schedule.py``); a checkpoint keeps both."""

    def lagging_rows(self) -> dict[str, torch.Tensor] | None:
        """With an update pending: this rank's rows of the parameters forward computes with, one update behind
        :attr:`ShardRecord.rows`, by name; None when none is pending (``checkpoint/delayed_update.py``)."""

    def load_lagging_rows(self, rows: Mapping[str, torch.Tensor]) -> None:
        """Collective, after a checkpoint's rows were loaded: make ``rows`` (as :meth:`lagging_rows` gave them) the
        parameters forward computes with; the next step sends the loaded rows to them."""


@runtime_checkable
class SelectiveUpdateState(Protocol):
    """``offload_update_interval > 1`` (stages 1-2): the interval's gradient sums, the chosen columns, their step counts
    and the progress of the schedule ([Note: selective updates] in ``offload/selective.py``), by parameter name."""

    def selective_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """By name: whole tensors, the same on every rank, and ``sums``, this rank's rows
        (``checkpoint/selective_updates.py``)."""

    def load_selective_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """After the optimizer's state was loaded: restore what :meth:`selective_state` gave (``sums`` as this rank's
        rows)."""


@runtime_checkable
class ShardingEngine(Protocol):
    """What the strategy, precision plugin, checkpoints and accounting ask of an engine."""

    # Read-only to callers: an engine may hold each as an attribute or compute it.

    @property
    def stage(self) -> int: ...

    @property
    def rank(self) -> int:
        """This rank's index among the ranks a parameter's rows are spread over."""

    @property
    def world_size(self) -> int:
        """How many ranks a parameter's rows are spread over."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        """Those ranks (None: every rank)."""

    @property
    def mesh(self) -> DeviceMesh:
        """The same ranks as a 1-D mesh, for DTensor checkpoints."""

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """Hybrid sharding: the ranks holding the same rows as this one, one per shard group (None: no copies)."""

    @property
    def norm_group(self) -> dist.ProcessGroup | None:
        """Ranks whose gradient shards are disjoint and together cover every trainable parameter once: a global
        norm sums its squares over these (None: every rank)."""

    @property
    def holding(self) -> Holding:
        """Which of the module's tensors this rank holds (all of them unless pipeline stages split the model)."""

    @property
    def holds_masters(self) -> bool:
        """True when a parameter's trainable rows live apart from the resident parameter (fp32 masters of a
        mixed-precision run, host copies of offload): checkpoints read :attr:`ShardRecord.rows` then."""

    @property
    def optimizer_on_host(self) -> bool:
        """Optimizer state (and the step) lives in host memory (``offload_optimizer``, or ``offload_params``)."""

    @property
    def gathered_units(self) -> GatheredUnits | None:
        """Stage 3: parameters sharded as DTensors and gathered per unit; None where every rank holds them whole
        (stages 1-2). What averaging, compiling and pipeline schedules ask, rather than the stage."""

    @property
    def delayed_update(self) -> DelayedUpdate | None:
        """The parameters forward computes with lag the optimizer by one update (``offload_step_delay``); None
        where they never lag."""

    @property
    def selective_updates(self) -> SelectiveUpdateState | None:
        """Selective updates' state beyond the optimizer's (``offload_update_interval > 1``); None without them."""

    @property
    def compression(self) -> CompressedComm | None:
        """The compressed gradient communication in use (None: full precision). Its error-feedback residuals are
        per-rank training state that sharded checkpoints keep (``checkpoint/error_feedback.py``)."""

    def wrap_optimizer(
        self, optimizer: Optimizer, elementwise: tuple[type, ...] = (), matrix: tuple[type, ...] = ()
    ) -> None:
        """Take over ``optimizer``'s steps; ``elementwise`` / ``matrix``: classes the user declared of each kind
        (``optimizers.optimizer_kind``), others refused with a message saying how to declare them."""

    def optimizer_shards(self, optimizer: Optimizer) -> OptimizerShards: ...

    def records(self) -> list[ShardRecord]:
        """Every trainable parameter this rank holds, in module order."""

    def state_tensors(self) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """``(kind, tensor, on_host)`` for the model state the engine holds beyond the module's parameters and
        their ``.grad`` (masters, gradient buffers): the terms memory accounting adds."""

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether the engine placed ``tensor`` (a tensor the optimizer keys its state by) in host memory, so its
        optimizer state lives there too. With partial offload some do and some do not; on a CPU-only run, where
        host and device are one memory, this is the only way to tell them apart."""

    def bucket_layout(self) -> list[int] | None:
        """This rank's segment size of each gradient bucket, in order, where gradients are reduced in buckets
        (stages 1-2); None where they are reduced per parameter (stage 3). Per-rank state laid out by the buckets
        (error-feedback residuals) carries over only into a run with the same list."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """A block of non-final accumulation micro-batches: no gradient communication."""

    @property
    def synchronizing(self) -> bool:
        """False inside :meth:`no_sync`: a backward now reduces no gradients."""

    def step_during_backward(self, optimizer: Optimizer, clipped: bool = False) -> None:
        """The coming backward is the step's only one, and nothing after it changes the gradients or skips the step
        (no loss scaler), unless ``clipped``: Lightning's clipping by the global norm: the engine may start
        ``optimizer``'s host step while backward still runs (see [Note: the host step during backward]; clipped,
        speculatively: [Note: speculative clipping]), or ignore this."""

    def post_backward(self) -> None:
        """After each backward; after the final micro-batch's: land the gradient reductions still in flight."""

    def discard_all_gradients(self) -> None:
        """Start a new accumulation window: whatever was reduced and not stepped is dropped."""

    def follow_trainability(self) -> bool:
        """Between steps: take in parameters made trainable during ``fit``; whether anything changed."""

    def params_loaded(self) -> None:
        """A checkpoint was written into :attr:`ShardRecord.rows`: refresh what derives from them (collective)."""

    def restore_master_params(self) -> None:
        """Give the module its parameters at full precision when training ends, every delayed update landed
        (collective)."""

    def teardown(self) -> None: ...
