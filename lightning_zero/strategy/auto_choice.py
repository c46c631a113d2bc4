"""``ZeroStrategy(stage="auto")`` under a ``Trainer``: the planner's choice made when ``fit`` starts.

[Note: when zero_auto chooses]
Lightning runs ``setup_environment`` (the process group), the data and module ``setup`` hooks, ``configure_model``
(under ``model_sharded_context``, where stage 3 builds on the meta device), then ``strategy.setup`` (sharding). The
choice is made at the first of ``model_sharded_context`` and ``setup``: after the DataLoader can give a batch, and
before any parameter ``configure_model`` builds is materialised, since stage 3 builds them on the meta device and
the others where they are. Until then ``strategy.stage`` is ``"auto"`` and every reader of the settings answers as
for a configuration that has chosen nothing (``ZeroConfig.chosen``).

The sample batch is the train DataLoader's first, through the module's batch-transfer hooks (on the host): the
planner traces one ``training_step`` and backward of a copy of the module under fake tensors (``configure_model``
included), so nothing is computed or allocated. The RNG state is put back afterwards: drawing that batch advanced a
shuffling sampler's generator, which the run's own first epoch must find where it was.

Every rank reads its free memory (``device_memory`` overrides it), and the smallest over the ranks is the budget;
rank 0 alone traces and chooses, and broadcasts the choice (or its refusal, so every rank raises the same error
before training). The choice is written into every checkpoint; a fit resumed from one reuses it, since another
micro-batch or precision of the step would not continue the same run.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_zero.checkpoint.verify import META_FILE, CheckpointError, read_checkpoint_dict
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.engine.comm import collectives
from lightning_zero.planning.auto import AUTO_SETTINGS, AutoChoice, Budget, choose, repeated_block, splittable
from lightning_zero.planning.formulas import format_bytes, unit_for
from lightning_zero.planning.measure import PeakWindow
from lightning_zero.planning.plan import NothingFits, Planner
from lightning_zero.planning.trace import COMPUTE_DTYPES
from lightning_zero.resume.rng import collect_rng_state, restore_rng_state
from lightning_zero.torch_versions.tracing import FakeCopyMode, FakeTensorMode, tree_leaves

#: Where a checkpoint records the choice.
CHECKPOINT_KEY = "lightning_zero_auto"


P = ParamSpec("P")
S = TypeVar("S")


def records_given_arguments(init: Callable[Concatenate[S, P], None]) -> Callable[Concatenate[S, P], None]:
    """Decorates a strategy's ``__init__`` to keep, as ``_given_arguments``, the names of the arguments its caller
    gave: under ``stage="auto"`` each is a constraint, even at its default (``offload_optimizer=False``: never
    offload). LightningCLI passes every argument, its defaults filled in; from such a call only the arguments that
    differ from their defaults count as given. The signature is unchanged (``inspect.signature`` follows
    ``__wrapped__``), so LightningCLI still reads the typed parameters."""
    signature = inspect.signature(init)
    parameters = [name for name in signature.parameters if name != "self"]

    @functools.wraps(init)
    def recording(self: S, *args: P.args, **kwargs: P.kwargs) -> None:
        bound = signature.bind(self, *args, **kwargs).arguments
        given = {name for name in bound if name != "self"}
        if given == set(parameters):
            given = {name for name in given if bound[name] != signature.parameters[name].default}
        self._given_arguments = frozenset(given)  # type: ignore[attr-defined]
        init(self, *args, **kwargs)

    return recording


class AutoChoosing:
    """The choice of one ``ZeroStrategy(stage="auto")``: made once (the first ``fit``, or read from the checkpoint it
    resumes), then kept for every later run of the strategy."""

    def __init__(self, config: ZeroConfig, given: Collection[str]) -> None:
        #: The strategy's settings as given, ``stage="auto"`` among them.
        self.settings = {name: getattr(config, name) for name in config.__dataclass_fields__}
        #: The settings the user gave: constraints the choice keeps.
        self.given = frozenset(given)
        self.choice: AutoChoice | None = None
        #: The checkpoint the run will load (the launcher resolves it before any process group exists).
        self.ckpt_path: str | None = None

    def chosen_config(self, module: pl.LightningModule) -> ZeroConfig:
        """The strategy's settings with the choice in them, as a hand-written configuration would have them."""
        if self.choice is None:
            raise RuntimeError("lightning_zero internal error: the choice is made before it is applied")
        settings = dict(self.choice.settings)
        if settings.pop("activation_checkpointing"):
            given = self.settings["activation_checkpointing"]
            policy = given if given is not None else _block_of(module)
            if policy is None:
                raise ZeroConfigError(
                    "zero_auto chose activation checkpointing in an earlier run, but this module has no repeated "
                    "block (no nn.ModuleList) to checkpoint. Resume with a stage named by hand."
                )
            settings["activation_checkpointing"] = policy
        else:
            settings["activation_checkpointing"] = None
        return ZeroConfig(**{**self.settings, **AUTO_SETTINGS, **settings})

    def choose(self, strategy: Any, trainer: pl.Trainer, module: pl.LightningModule) -> AutoChoice:
        """Collective: the ranks agree on the budget, rank 0 chooses (or reads the resumed checkpoint's choice) and
        broadcasts it; every rank raises the same error where nothing fits."""
        budget = self._budget(strategy)
        payload: dict[str, Any] = {}
        self._phase = "choose"  # what rank 0 was doing, for the error every rank raises
        if strategy.global_rank == 0:
            state = collect_rng_state()
            try:
                payload = self._choice_on_rank_zero(strategy, trainer, module, budget)
            except (NothingFits, ZeroConfigError) as err:
                payload = {"error": type(err).__name__, "message": str(err)}
            except Exception as err:  # the trace runs the user's code: every rank must hear of its failure
                payload = {
                    "error": "ZeroConfigError",
                    "message": f"`stage='auto'` could not {self._phase} ({type(err).__name__}: {err}). Name a stage by "
                    "hand (`lightning-zero plan` predicts each one's memory).",
                }
            finally:
                restore_rng_state(state)
        payload = collectives.broadcast_object(payload, src=0)
        if "error" in payload:
            raise (NothingFits if payload["error"] == "NothingFits" else ZeroConfigError)(payload["message"])
        choice = AutoChoice.from_record(payload["choice"])
        self.choice = AutoChoice(**{**choice.__dict__, "table": payload.get("table", "")})
        if strategy.global_rank == 0:
            rank_zero_info(payload.get("table") or f"zero_auto: {payload['reused']}")
        return self.choice

    def _choice_on_rank_zero(
        self, strategy: Any, trainer: pl.Trainer, module: pl.LightningModule, budget: Budget
    ) -> dict[str, Any]:
        recorded = _recorded_choice(self.ckpt_path)
        if recorded is not None:
            choice = AutoChoice.from_record(recorded)
            return {
                "choice": choice.record(),
                "reused": f"{self.ckpt_path} recorded its choice: {choice.describe()}",
            }
        if trainer.state.fn != TrainerFn.FITTING:
            raise ZeroConfigError(
                f"`stage='auto'` chooses when `fit` starts (it traces a training step), and this `{trainer.state.fn}` "
                "has no fit before it and no checkpoint that recorded a choice. Fit first, pass the fit's "
                "checkpoint as `ckpt_path`, or name a stage."
            )
        config = strategy.zero_config
        precision = strategy.precision_plugin.precision
        if precision not in COMPUTE_DTYPES:
            raise ZeroConfigError(
                f"`stage='auto'` plans {sorted(COMPUTE_DTYPES)}, not precision={precision!r}. Name a stage, or use "
                "one of those precisions."
            )
        if not module.automatic_optimization:
            raise ZeroConfigError(
                "`stage='auto'` traces a training step as automatic optimization runs it (training_step, then "
                "backward of its loss); this module optimizes manually (its training_step calls the optimizers "
                "itself), which a trace cannot follow. Name a stage (`lightning-zero plan` predicts each one's memory)."
            )
        self._phase = "read the train DataLoader's first batch"
        batch = _sample_batch(trainer, module)
        # Under sequence parallelism the batch is cut along the sequence before the step: its parts would no longer
        # be the labels the wiring matched (sequence_parallel/causal_lm.py), so it is kept whole.
        split = splittable(batch) and config.sequence_parallel_size == 1
        self._phase = "find the module's repeated block (a copy, on fake tensors)"
        given_policy = self.settings["activation_checkpointing"]
        planner = Planner(
            lambda: copy.deepcopy(module),
            batch,
            world_size=strategy.world_size,
            precision=precision,
            accumulate=trainer.accumulate_grad_batches,
            checkpointing=given_policy if given_policy is not None else _block_of(module),
            devices_per_host=strategy.num_processes,
            bucket_size_mb=config.bucket_size_mb,
            unit_size_mb=config.unit_size_mb,
            backend=_backend(strategy),
            optimizer_state_dtype=config.optimizer_state_dtype,
            clipped=bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm"),
            tiled_compute=config.tiled_compute,
            sequence_parallel_size=config.sequence_parallel_size,
        )
        self._phase = "trace the module's training_step (a copy, on fake tensors) on the train DataLoader's first batch"
        choice = choose(planner, budget, self.settings, self.given, split=split)
        table = choice.table
        if not split and planner.per_device > 1:
            why = (
                "each sample is shared by the ranks of a sequence-parallel group"
                if config.sequence_parallel_size > 1
                else "the batch is not a tensor, or a dict, list or tuple of tensors sharing their first dimension, "
                "so the strategy cannot split it"
            )
            table += f"\n(micro-batches smaller than the batch were not weighed: {why}.)"
        return {"choice": choice.record(), "table": table}

    def _budget(self, strategy: Any) -> Budget:
        """Collective: the memory every rank can count on (the smallest over the ranks)."""
        device = strategy.root_device
        given = self.settings["device_memory"]
        host = _available_host_memory()
        if given is not None:
            memory, source = float(given), "device_memory"
        elif device.type == "cuda":
            memory, source = float(torch.cuda.mem_get_info(device)[0]), f"free on {torch.cuda.get_device_name(device)}"
        else:
            memory, source = host / max(1, strategy.num_processes), "the host's available memory per rank"
        readings = collectives.all_gather_objects((memory, host))
        memory, host = min(m for m, _ in readings), min(h for _, h in readings)
        if len(readings) > 1 and given is None:
            source += ", the least over the ranks"
        offload_host = host if (given is not None or device.type != "cpu") else None
        return Budget(memory, float(self.settings["memory_headroom"]), offload_host, source)


def _available_host_memory() -> float:
    """Bytes of host memory available to new allocations (psutil's ``available``; the free pages without it)."""
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except ImportError:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _backend(strategy: Any) -> str:
    backend = strategy.process_group_backend
    if backend is not None:
        return backend
    return "nccl" if strategy.root_device.type == "cuda" else "gloo"


def _sample_batch(trainer: pl.Trainer, module: pl.LightningModule) -> Any:
    """The train DataLoader's first batch, through the module's transfer hooks, on the host."""
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        raise ZeroConfigError(
            "`stage='auto'` traces a training step on the train DataLoader's first batch, and this fit has no "
            "train DataLoader."
        )
    loaders = source.dataloader()
    generators = _generators(loaders)  # a loader's or sampler's own: drawing a batch advances them too
    states = [generator.get_state() for generator in generators]
    combined = CombinedLoader(loaders, "max_size_cycle")
    iter(combined)
    try:
        batch, _, _ = next(combined)
    except StopIteration:
        raise ZeroConfigError("`stage='auto'`: the train DataLoader gave no batch to trace a step on.") from None
    finally:
        combined.reset()
        for generator, state in zip(generators, states):
            generator.set_state(state)
    batch = module.on_before_batch_transfer(batch, 0)
    batch = module.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    return module.on_after_batch_transfer(batch, 0)


def _generators(loaders: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects of the DataLoaders in ``loaders`` (a loader, or a dict or list of them), their
    samplers and batch samplers."""
    found: list[torch.Generator] = []
    for loader in tree_leaves(loaders):
        for holder in (
            loader,
            getattr(loader, "sampler", None),
            getattr(getattr(loader, "batch_sampler", None), "sampler", None),
        ):
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
                found.append(generator)
    return found


def _block_of(module: pl.LightningModule) -> type[torch.nn.Module] | None:
    """The repeated block of the module, as ``configure_model`` builds it (on a fake copy when it builds layers)."""
    found = repeated_block(module)
    if found is not None or not callable(getattr(module, "configure_model", None)):
        return found
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True) as fake, FakeCopyMode(fake):
        warnings.simplefilter("ignore")
        copied: pl.LightningModule = copy.deepcopy(module)
        copied.configure_model()
    return repeated_block(copied)


def _recorded_choice(ckpt_path: str | None) -> Mapping[str, Any] | None:
    """The choice a checkpoint recorded (None: no checkpoint, or one written without ``stage="auto"``)."""
    if ckpt_path is None or not Path(ckpt_path).exists():
        return None
    path = Path(ckpt_path)
    try:
        checkpoint = read_checkpoint_dict(path / META_FILE if path.is_dir() else path, mmap=path.is_file())
    except CheckpointError:
        return None  # the load itself reports what is wrong with it, in its place
    return checkpoint.get(CHECKPOINT_KEY)


class FirstStepsPeak(pl.Callback):
    """The measured peak of the fit's second optimizer step (its accumulation window, whole) beside the prediction:
    logged, and warned about where it exceeds the prediction by more than the headroom. The second, since the first
    makes the optimizer state and a first step's one-time buffers, which the prediction (a step in the steady state)
    does not count; the planner's calibration measures the same window (``planning/measure.py``).

    On a GPU it is the device's ``max_memory_allocated``, against the predicted device peak. On a CPU device and host
    are one memory: torch's ``MemTracker`` counts the run's live tensors, against the predicted device peak plus what
    the choice puts on the host. Every rank opens and closes the window at the same optimizer steps, and the peaks
    are gathered there."""

    def __init__(self, choice: AutoChoice) -> None:
        self.choice = choice
        #: Every rank's measured peak, once measured.
        self.peaks: list[int] = []
        self._window = PeakWindow()
        self._first_step: int | None = None  # the fit's first optimizer step (a resumed fit's is not 0)
        self._open = False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._first_step is None:
            self._first_step = trainer.global_step
        if self.peaks or self._open or trainer.global_step != self._first_step + 1:
            return
        self._open = True
        self._window.open(trainer, pl_module, batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._open and self._first_step is not None and trainer.global_step == self._first_step + 2:
            self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        self._open = False
        cuda = trainer.strategy.root_device.type == "cuda"
        peak = self._window.close(trainer)
        expected = self.choice.predicted_device + (0 if cuda else self.choice.predicted_host)
        self.peaks = [int(p) for p in collectives.all_gather_objects(int(peak))]
        measured = max(self.peaks)
        unit = unit_for(measured, expected)
        where = "per device" if cuda else "per rank (device and host: one memory on a CPU run)"
        line = (
            f"zero_auto: measured peak {format_bytes(measured, unit)} {where} over the second optimizer step; "
            f"predicted {format_bytes(expected, unit)}"
        )
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(
                {"zero_auto/measured_peak_bytes": measured, "zero_auto/predicted_peak_bytes": expected},
                step=trainer.global_step,
            )
        if measured > expected * (1 + self.choice.headroom):
            rank_zero_warn(
                f"{line}: over the prediction by {measured / expected - 1:.0%}, more than the "
                f"{self.choice.headroom:.0%} headroom. The run may not fit where the budget is tight: raise "
                "`memory_headroom`, or give a smaller `device_memory`."
            )
        else:
            rank_zero_info(line + ".")

    def close(self) -> None:
        """Stop measuring (a run that ends, or fails, inside the window): the tracker's dispatch mode and hooks go."""
        self._open = False
        self._window.abandon()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()
