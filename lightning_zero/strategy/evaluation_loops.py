"""Lightning's evaluation loops under ``torch.no_grad`` rather than ``torch.inference_mode``.

Lightning runs ``validate``, ``test`` and ``predict`` under inference mode wherever the process group is not gloo,
that is on GPUs, except for its own FSDP strategy and XLA. A tensor made under inference mode can never take part in
autograd, and the tensors a sharded model makes at its first forward are kept for the training that follows: FSDP2
creates each unit's unsharded parameters at its first all-gather, so a stage-3 ``validate`` (or ``test``, or
``predict``) before ``fit`` left them inference tensors, and the first training forward raised "Inference tensors do
not track version counter". ``torch.no_grad`` gives evaluation the same numbers and memory and leaves them usable.
"""

from __future__ import annotations

import lightning.pytorch as pl


def evaluate_under_no_grad(trainer: pl.Trainer) -> None:
    """Turn inference mode off in every evaluation loop of ``trainer`` (the fit's validation already runs without)."""
    loops = (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop)
    for loop in loops:
        loop.inference_mode = False
