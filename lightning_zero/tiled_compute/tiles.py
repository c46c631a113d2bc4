"""Computing over a sequence in tiles, each recomputed in backward: the public helpers a module calls for its own MLP
and its LM head with the loss.

[Note: sequence tiles]
At a long sequence two activations dwarf the rest of a transformer step: the MLP's ``[T, 4d]`` intermediate (several
per block, each ``4x`` the block's input) and the LM head's ``[T, vocab]`` logits with the cross-entropy's gradient of
the same size (a 32K vocabulary at 64K tokens: 8 GiB in fp32, twice). Both are computed position by position, so
they can be computed a tile of positions at a time (ALST's TiledMLP and tiled loss). Each tile runs under torch's
non-reentrant checkpoint, which keeps only the tile's input (a view of the whole input, no copy) and recomputes the
tile in its backward; autograd runs one tile's recomputation and backward before the next tile's (each tile's nodes
were created after the previous tile's), so at most one tile's intermediate exists at a time. The parameters'
gradients reach autograd's accumulation once per backward, summed over the tiles, as for any parameter used several
times: the engines' gradient hooks and FSDP2 see one gradient, as without tiling.

The results equal the untiled computation's up to the order of fp32 sums: a weight's gradient is the sum of the
tiles' products instead of one product over all positions, and the loss the sum of the tiles' sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: The logits a tile of :func:`tiled_cross_entropy` computes at most by default (elements: 64 MiB in fp32).
LOSS_TILE_ELEMENTS = 2**24


def tiled_forward(
    function: Callable[..., torch.Tensor], hidden: torch.Tensor, *args: Any, tile_size: int, **kwargs: Any
) -> torch.Tensor:
    """``function(hidden, *args, **kwargs)`` computed ``tile_size`` positions of the sequence (``hidden``'s
    second-to-last dimension: ``[B, T, d]`` or ``[T, d]``) at a time, each tile recomputed in backward (see [Note:
    sequence tiles]). ``function`` must treat positions independently (an MLP, a projection); it returns one tensor
    with the sequence in the same dimension. Tensor ``args`` with ``hidden``'s leading shape (a residual beside the
    hidden states, as Bloom's MLP takes) are split with it; other ``args`` and ``kwargs`` go whole to every tile."""
    _check_tile_size(tile_size)
    if hidden.shape[-2] <= tile_size:
        return function(hidden, *args, **kwargs)
    outputs = []
    on_tile = _OnContiguousTile(function)
    per_position = [isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[:-1] == hidden.shape[:-1] for a in args]
    split = [a.split(tile_size, dim=-2) if tiled else None for a, tiled in zip(args, per_position)]
    for index, tile in enumerate(hidden.split(tile_size, dim=-2)):
        tile_args = tuple(parts[index] if parts is not None else a for a, parts in zip(args, split))
        if torch.is_grad_enabled():
            output = checkpoint(on_tile, tile, *tile_args, use_reentrant=False, **kwargs)
        else:
            output = on_tile(tile, *tile_args, **kwargs)
        if not isinstance(output, torch.Tensor):
            name = getattr(function, "__qualname__", type(function).__name__)
            raise TypeError(
                f"tiled_forward: {name} returned {type(output).__name__}, not one tensor; only a function of each "
                "position that returns one tensor can be computed in tiles."
            )
        outputs.append(output)
    return torch.cat(outputs, dim=-2)


class _OnContiguousTile:
    """``function`` of a tile made contiguous (a tile of ``[B, T, d]`` is a strided view, which a layer reshaping
    with ``view``, as GPT-2's ``Conv1D`` does, refuses). The checkpoint keeps the view, no copy; the contiguous copy
    lives while the tile computes."""

    def __init__(self, function: Callable[..., torch.Tensor]) -> None:
        self.function = function

    def __call__(self, tile: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.function(tile.contiguous(), *args, **kwargs)


def _tile_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """One tile's summed cross-entropy, its logits upcast to fp32 as Hugging Face's loss does."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)`` without the whole logits: the LM head and
    the loss computed ``tile_size`` positions at a time, each tile recomputed in backward ([Note: sequence tiles]).

    ``hidden`` is ``[..., d]`` (the last hidden states), ``labels`` the matching ``[...]`` targets, already aligned
    with the positions (for a causal LM: shifted left by one, the last position ``ignore_index``). ``reduction``:
    ``"mean"`` over the positions whose label is not ``ignore_index``, or ``"sum"``. ``tile_size`` defaults to the
    positions whose logits hold :data:`LOSS_TILE_ELEMENTS`."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"tiled_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}.")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"tiled_cross_entropy: labels {tuple(labels.shape)} must match hidden {tuple(hidden.shape)} but its last "
            "dimension (one label per position, already shifted for a causal LM)."
        )
    rows = tile_size if tile_size is not None else max(1, LOSS_TILE_ELEMENTS // weight.shape[0])
    _check_tile_size(rows)
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    total: torch.Tensor | None = None
    for tile, targets in zip(flat_hidden.split(rows), flat_labels.split(rows)):
        if torch.is_grad_enabled():
            loss = checkpoint(_tile_loss, tile, weight, bias, targets, ignore_index, use_reentrant=False)
        else:
            loss = _tile_loss(tile, weight, bias, targets, ignore_index)
        total = loss if total is None else total + loss
    if total is None:
        raise ValueError("tiled_cross_entropy: no positions to compute the loss of.")
    if reduction == "sum":
        return total
    return total / (flat_labels != ignore_index).sum()


def _check_tile_size(tile_size: Any) -> None:
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"tile_size must be a positive number of positions, got {tile_size!r}.")
