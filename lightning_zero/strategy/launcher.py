"""Process launching for ZeroStrategy.

Both launchers resolve the run's ``ckpt_path`` first (auto-resume after a launcher restart, ``"last"`` among complete
checkpoints only; see :mod:`lightning_zero.resume.ckpt_path`): Lightning fixes ``ckpt_path`` inside the function they
launch, before the process group exists, so this is the last place it can still be chosen. It is also the first place
that sees the Trainer and the ``fit`` arguments together: a ``ckpt_path`` that is missing or not a whole checkpoint
(``strategy/early_checks.py``, in the process that starts the others: a rank started by torchrun or by Lightning may
be given a path only rank 0's folder holds), and a DeepSpeed config that disagrees with the Trainer's clipping,
accumulation or the training DataLoader's batch size (``deepspeed_compat/trainer.py``), are refused here, before any
process starts (a rank that torchrun or SLURM started has no such moment: Lightning checks the path there, on each
rank).

* :class:`ZeroScriptLauncher` (``start_method="popen"``): Lightning's script launcher when Lightning starts the
  processes; when a launcher such as ``torchrun`` or SLURM started them (``creates_processes_externally``) it
  starts nothing and only resolves ``ckpt_path``. Lightning's observer of the child processes kills every
  process, this one included, as soon as a child dies; ours first leaves the watchdog of this process the time to
  say why (a child that gloo aborted on a mismatched collective names nobody itself, see ``faults/postmortem.py``).
* :class:`ZeroMultiProcessingLauncher` (``spawn``/``fork``): runs hand the trained weights back to the main
  process; Lightning's launcher does that with ``lightning_module.state_dict()``, which under stage 3 holds
  DTensor shards the main process cannot load. This launcher sends the gathered full state dict instead, so
  ``trainer.fit`` leaves the user's module in the main process holding the trained, unsharded weights for
  every stage.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_zero.deepspeed_compat.trainer import apply_to_trainer, check_batch_sizes
from lightning_zero.faults.diagnosis_types import Limits
from lightning_zero.resume import resolve_ckpt_path
from lightning_zero.strategy.early_checks import check_ckpt_path


def _resolved(
    strategy, function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None, starts_processes: bool
) -> tuple[tuple, dict]:
    if trainer is not None:
        if starts_processes:  # a rank started by another reads the path the launching process checked, or rank 0's
            _check_ckpt_path(function, args, kwargs, trainer)
        _check_deepspeed_settings(strategy, function, args, kwargs, trainer)
    args, kwargs, decision = resolve_ckpt_path(function, args, kwargs, trainer, strategy.zero_config.auto_resume)
    strategy._resume.decision = decision
    if strategy._auto is not None:  # stage="auto" reuses the choice the checkpoint it resumes recorded
        strategy._auto.ckpt_path = _ckpt_path_of(function, args, kwargs, trainer)
    return args, kwargs


def _ckpt_path_of(function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None) -> str | None:
    """The checkpoint the run will load: ``ckpt_path`` as resolved, else ``trainer.ckpt_path``."""
    try:
        given = inspect.signature(function).bind(*args, **kwargs).arguments.get("ckpt_path")
    except TypeError:
        given = None
    if given is None and trainer is not None:
        given = trainer.ckpt_path
    return str(given) if given is not None else None


def _check_ckpt_path(function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer) -> None:
    """The checkpoint to load exists and is whole: found here, before any rank starts, it is one error rather than
    a traceback from every rank. The path set as ``trainer.ckpt_path = ...`` too, which Lightning loads when the
    call is given none."""
    try:
        given = inspect.signature(function).bind(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return
    if given is not None:
        check_ckpt_path(given)
    elif getattr(trainer._checkpoint_connector, "_user_managed", False):
        check_ckpt_path(trainer.ckpt_path, setting="trainer.ckpt_path")


def _check_deepspeed_settings(strategy, function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer) -> None:
    settings = strategy.deepspeed_settings
    if settings is None:
        return
    apply_to_trainer(settings, trainer)
    try:
        loader = inspect.signature(function).bind(*args, **kwargs).arguments.get("train_dataloaders")
    except (TypeError, ValueError):
        return
    if trainer.state.fn == TrainerFn.FITTING and isinstance(loader, DataLoader):
        ranks = strategy.num_nodes * strategy.num_processes
        replicas = ranks // strategy.zero_config.sequence_parallel_size  # a sequence-parallel group shares each sample
        check_batch_sizes(settings, trainer, loader, world_size=replicas)


class ZeroScriptLauncher(_SubprocessScriptLauncher):
    def __init__(self, strategy, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return self.cluster_environment.creates_processes_externally  # nothing is started: as without a launcher

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        external = self.cluster_environment.creates_processes_externally
        args, kwargs = _resolved(self._strategy, function, args, kwargs, trainer, starts_processes=not external)
        if external:
            return function(*args, **kwargs)  # torchrun / SLURM / a parent Lightning process started this one
        # As Lightning's launch, with our observer.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        self._call_children_scripts()
        config = self._strategy.zero_config
        grace = Limits.for_timeout(config.timeout_delta.total_seconds()).margin + 5.0 if config.watchdog else 0.0
        _PatientObserver(self.procs, main_pid=os.getpid(), grace=grace).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class _PatientObserver(_ChildProcessObserver):
    """Lightning's observer, but a child's death ends the other processes only ``grace`` seconds later: by then this
    process's watchdog has printed its diagnosis and ended the process itself (the observer thread ends with it),
    or it is stuck and gets killed as before."""

    def __init__(self, child_processes: list, main_pid: int, grace: float) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=1)
        self._grace = grace

    @override
    def _terminate_all(self) -> None:
        time.sleep(self._grace)
        super()._terminate_all()


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        args, kwargs = _resolved(self._strategy, function, args, kwargs, trainer, starts_processes=True)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        # Collective: every rank takes part in gathering the shards.
        # This launcher's strategy is a ZeroStrategy (it made the launcher), which Lightning's annotation cannot say.
        state_dict = (
            self._strategy.full_state_dict()  # type: ignore[attr-defined]
            if trainer.state.fn == TrainerFn.FITTING
            else None
        )
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(prefix="lightning_zero-weights-"), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        """Lightning removes the weights file once loaded; its folder goes too, or every spawned run leaves one."""
        try:
            super()._recover_results_in_main_process(worker_output, trainer)
        finally:
            if worker_output.weights_path is not None:
                shutil.rmtree(os.path.dirname(worker_output.weights_path), ignore_errors=True)
