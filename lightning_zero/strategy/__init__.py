"""The Lightning wiring: the strategy, its processes and process group, sharding set-up, checkpoint hooks,
the launcher, fault handling, SWA and compile."""

from lightning_zero.strategy.zero_strategy import ZeroStrategy

__all__ = ["ZeroStrategy"]
