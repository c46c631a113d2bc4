"""Process launching for ZeroStrategy.

``spawn``/``fork`` runs hand the trained weights back to the main process; Lightning's launcher does that
with ``lightning_module.state_dict()``, which under stage 3 holds DTensor shards the main process cannot
load. This launcher sends the gathered full state dict instead, so ``trainer.fit`` leaves the user's
module in the main process holding the trained, unsharded weights for every stage.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
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
