"""Moved to :mod:`lightning_zero.planning.accounting` (the planner's package); this name stays importable."""

from lightning_zero.planning.accounting import live_tensor_bytes, model_state_bytes, saved_tensor_bytes  # noqa: F401
