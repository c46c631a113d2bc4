"""ZeRO for Lightning Fabric loops: ``L.Fabric(strategy="zero3")`` or ``L.Fabric(strategy=ZeroStrategy(stage=3))``
(docs/fabric.md)."""

from lightning_zero.fabric.strategy import ZeroStrategy

__all__ = ["ZeroStrategy"]
