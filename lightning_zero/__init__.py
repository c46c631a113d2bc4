"""lightning_zero: ZeRO stages 1-3 for PyTorch Lightning, with nothing but PyTorch underneath.

``import lightning_zero`` registers the strategy names of ``lightning_zero.config.zero_config.REGISTERED_STRATEGIES``
with Lightning (``zero1``, ``zero1_offload``, ``zero1_hsdp``, ``zero2``, ``zero2_offload``, ``zero2_offload_delay``,
``zero2_hsdp``, ``zero2_compressed``, ``zero3``, ``zero3_offload_optimizer``, ``zero3_offload``, ``zero3_hsdp``,
``zero3_hpz``, ``zero3_compressed``), so ``Trainer(strategy="zero3")`` works, the same names with Lightning Fabric
(``L.Fabric(strategy="zero3")``, ``lightning_zero.fabric``), and makes an unknown ``zero…`` name
(``"zero4"``) answer with these names rather than Lightning's generic list (``strategy/early_checks.py``). A torch
outside the tested range (2.11 through 2.14) gets a warning here ([Note: version adapters] in ``torch_versions/``).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoint import (
    CheckpointEntry,
    CheckpointError,
    CheckpointSaveError,
    UnsafeCheckpointError,
    list_checkpoints,
)
from lightning_zero.checkpoint.module_loading import load_from_checkpoint
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from lightning_zero.observability.gradient_norms import grad_norm
from lightning_zero.observability.monitor import ZeroMonitor
from lightning_zero.precision.zero_precision import ZeroPrecision
from lightning_zero.pretrained import load_pretrained
from lightning_zero.strategy.early_checks import explain_unknown_zero_names
from lightning_zero.strategy.zero_strategy import ZeroStrategy
from lightning_zero.tiled_compute import tiled_cross_entropy, tiled_forward
from lightning_zero.torch_versions import warn_if_untested

__all__ = [
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointSaveError",
    "UnsafeCheckpointError",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroMonitor",
    "ZeroPrecision",
    "ZeroStrategy",
    "grad_norm",
    "list_checkpoints",
    "load_from_checkpoint",
    "load_pretrained",
    "tiled_cross_entropy",
    "tiled_forward",
]
__version__ = "0.1.0"

if "zero1" not in StrategyRegistry:
    ZeroStrategy.register_strategies(StrategyRegistry)
if "zero1" not in FABRIC_STRATEGY_REGISTRY:  # the same names for `L.Fabric(strategy=...)` (fabric/strategy.py)
    FabricZeroStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
explain_unknown_zero_names(StrategyRegistry)
warn_if_untested()
