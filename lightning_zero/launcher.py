"""Process launching for ZeroStrategy.

Both launchers resolve the run's ``ckpt_path`` first (auto-resume after a launcher restart, ``"last"`` among
complete checkpoints only; see :mod:`lightning_zero.resume.decision`): Lightning fixes ``ckpt_path`` inside the
function they launch, before the process group exists, so this is the last place it can still be chosen.

* :class:`ZeroScriptLauncher` (``start_method="popen"``): Lightning's script launcher when Lightning starts the
  processes; when a launcher such as ``torchrun`` or SLURM started them (``creates_processes_externally``) it
  starts nothing and only resolves ``ckpt_path``.
* :class:`ZeroMultiProcessingLauncher` (``spawn``/``fork``): runs hand the trained weights back to the main
  process; Lightning's launcher does that with ``lightning_module.state_dict()``, which under stage 3 holds
  DTensor shards the main process cannot load. This launcher sends the gathered full state dict instead, so
  ``trainer.fit`` leaves the user's module in the main process holding the trained, unsharded weights for
  every stage.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero.resume import resolve_ckpt_path


def _resolved(strategy, function: Callable, args: tuple, kwargs: dict, trainer: pl.Trainer | None) -> tuple[tuple, dict]:
    args, kwargs, decision = resolve_ckpt_path(function, args, kwargs, trainer, strategy.zero_config.auto_resume)
    strategy._resume.decision = decision
    return args, kwargs


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
        args, kwargs = _resolved(self._strategy, function, args, kwargs, trainer)
        if self.cluster_environment.creates_processes_externally:
            return function(*args, **kwargs)  # torchrun / SLURM / a parent Lightning process started this one
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        args, kwargs = _resolved(self._strategy, function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        # Collective: every rank takes part in gathering the shards.
        state_dict = self._strategy.full_state_dict() if trainer.state.fn == TrainerFn.FITTING else None
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
