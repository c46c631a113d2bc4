"""The leaf settings: ZeroConfig and the checks of its values (the standard library and torch only)."""

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig

__all__ = ["ZeroConfig", "ZeroConfigError"]
