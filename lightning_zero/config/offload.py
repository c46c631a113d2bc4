"""The checks of the offload settings: ``offload_optimizer``, ``offload_params`` and ``offload_step_delay``."""

from __future__ import annotations

from typing import Any

from lightning_zero.config.choices import ZeroConfigError, check_choice


def check_offload(config: Any) -> None:
    """Validate (and normalise, on the frozen ``config``) the offload settings of a ZeroConfig."""
    ratio = config.offload_optimizer
    if not isinstance(ratio, bool) and (not isinstance(ratio, (int, float)) or not 0 < ratio <= 1):
        raise ZeroConfigError(f"`offload_optimizer` must be True, False or a share in (0, 1], got {ratio!r}.")
    if not isinstance(ratio, bool):
        object.__setattr__(config, "offload_optimizer", True if ratio == 1 else float(ratio))
    if config.offload_params and config.stage != 3:
        raise ZeroConfigError(
            f"`offload_params=True` needs `stage=3` (got stage={config.stage}): only stage 3 shards parameters."
        )
    delay = config.offload_step_delay
    check_choice("offload_step_delay", delay if not isinstance(delay, bool) else str(delay), (0, 1))
    if not delay:
        return
    if config.offload_optimizer is not True:
        raise ZeroConfigError(
            f"`offload_step_delay=1` runs the optimizer step on the host while the next step computes: it needs "
            f"`offload_optimizer=True` (every master on the host), got offload_optimizer={config.offload_optimizer!r}."
        )
    if config.stage == 3 or config.pipeline_stages > 1:
        setting = f"stage={config.stage}" if config.stage == 3 else f"pipeline_stages={config.pipeline_stages}"
        raise ZeroConfigError(
            f"`offload_step_delay=1` is built for stages 1 and 2 without pipeline stages, not `{setting}`: use "
            "stage=1 or 2 with offload_optimizer=True, or offload_step_delay=0."
        )
