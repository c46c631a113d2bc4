"""Lightning's redirection of a step method through the root module's forward, with the root's parameters whole for
the method's whole run.

Stage 3's root unit is the LightningModule itself, so Lightning calls ``training_step`` (and the evaluation steps)
through its ``__call__`` and FSDP2's root hooks gather the parameters no block holds (embeddings, a head, a loss's
weights) around it. A ``self(x)`` inside the method runs the root's hooks again, nested, and their post-forward would
reshard those parameters in the middle of the method: what it does with them afterwards (an ArcFace head on the
embeddings ``self(x)`` returned, a loss on a root layer) would meet shards. The engine keeps them gathered until the
method returns (``GatheredUnits.hold_root_gathered``); the outer post-forward reshards them as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import nn

from lightning_zero.engine.api import ShardingEngine


class _Sharding(Protocol):
    @property
    def engine(self) -> ShardingEngine | None: ...


class RootHeldRedirection(_ForwardRedirection):
    """Lightning's ``_ForwardRedirection``, holding the root gathered from the method's start to its return; it
    holds the strategy (not a function of it), so a strategy started with ``start_method="spawn"`` still pickles."""

    def __init__(self, strategy: _Sharding) -> None:
        self._strategy = strategy
        self._restore: Callable[[], None] | None = None

    def __call__(
        self,
        wrapper_module: nn.Module,
        original_module: pl.LightningModule,
        method_name: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        engine = self._strategy.engine
        gathered = engine.gathered_units if engine is not None else None
        self._restore = gathered.hold_root_gathered() if gathered is not None else None
        try:
            return super().__call__(wrapper_module, original_module, method_name, *args, **kwargs)
        finally:
            self._release()  # the method raised: nothing reached ``on_after_inner_forward``

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: pl.LightningModule) -> None:
        self._release()

    def _release(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
