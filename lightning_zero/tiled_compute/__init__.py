"""Tiled compute for long sequences: the MLP and the LM head with the loss computed a tile of positions at a time,
each tile recomputed in backward (``tiles.py``, the public helpers), and that switched on for Hugging Face causal LMs
by ``ZeroStrategy(tiled_compute=True)`` (``causal_lm.py``)."""

from lightning_zero.tiled_compute.causal_lm import apply_tiled_compute
from lightning_zero.tiled_compute.tiles import LOSS_TILE_ELEMENTS, tiled_cross_entropy, tiled_forward

__all__ = ["LOSS_TILE_ELEMENTS", "apply_tiled_compute", "tiled_cross_entropy", "tiled_forward"]
