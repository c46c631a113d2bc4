"""ZeroPrecision, the Lightning precision plugin, and the dynamic loss scaler it uses for 16-mixed."""

from lightning_zero.precision.zero_precision import ZeroPrecision

__all__ = ["ZeroPrecision"]
