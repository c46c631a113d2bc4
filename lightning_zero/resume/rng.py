"""Random-number generator states per rank, in a form ``torch.load(..., weights_only=True)`` reads.

Lightning's checkpoints do not carry RNG states; ours do, so a resumed run draws the same dropout masks
and random augmentations as an uninterrupted one. Numpy's state is stored as tensors and numbers, never
as a pickled array.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np

    _NUMPY = True
except ImportError:  # numpy is optional for torch
    _NUMPY = False


def collect_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if _NUMPY:
        legacy = np.random.get_state()
        if not isinstance(legacy, tuple):
            raise RuntimeError("lightning_zero internal error: the global RandomState is always an MT19937 one")
        key, keys, pos, has_gauss, cached = legacy
        state["numpy"] = {
            "key": key,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and _NUMPY:
        saved = state["numpy"]
        keys = saved["keys"].numpy().astype(np.uint32)
        np.random.set_state((saved["key"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
