"""Activation checkpointing: which blocks keep only their inputs in forward (``policy.py``), the hooks that
checkpoint a block's forward and recompute it once per backward (``checkpointed_forward.py``), the host tier those
inputs can be kept in (``offload.py``), and the running statistics a recomputation must not update twice
(``recomputed_buffers.py``)."""

from lightning_zero.activation_checkpointing.offload import ActivationOffload, OffloadStatistics
from lightning_zero.activation_checkpointing.policy import (
    ActivationCheckpointingError,
    CheckpointPolicy,
    activation_offload,
    apply_activation_checkpointing,
    caches_off_for_training,
    resolve_policy,
)

__all__ = [
    "ActivationCheckpointingError",
    "ActivationOffload",
    "CheckpointPolicy",
    "OffloadStatistics",
    "activation_offload",
    "apply_activation_checkpointing",
    "caches_off_for_training",
    "resolve_policy",
]
