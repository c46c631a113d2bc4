"""Ulysses attention: exchange heads for positions, attend over the whole sequence, exchange back.

Two ways in, one computation (:func:`ulysses_attention`):

- :class:`AttentionInterception`, a ``TorchFunctionMode`` the strategy holds around each step's forward, turns every
  ``F.scaled_dot_product_attention`` call of a module into the sequence-parallel one: the demo GPT, nanoGPT-style and
  LitGPT-style models need no change. Backward runs without it (torch does not carry the mode there): blocks
  checkpointed by the strategy enter it again as they recompute, a user's own non-reentrant checkpoint fails on the
  shapes, and a reentrant one (whose recomputation would silently attend locally) is refused in its forward.
- Hugging Face models get it through their attention interface: ``causal_lm.py`` points the instance's config at
  the ``"lightning_zero_ulysses"`` implementation registered here, and at a mask function that builds no mask (the
  model would build one for its ``T / k`` local positions, which is wrong after the exchange and ``O(T^2)``).

Both attend with ``is_causal`` and no mask, which is why a padding mask is refused when the batch is split.
Grouped-query attention keeps its key/value heads when ``k`` divides their number; when their number divides ``k``
each is replicated ``k / H_kv`` times before the exchange (as DeepSpeed does), so every rank gets the one its query
heads read; otherwise it is an error naming both numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.sequence_parallel import parallel
from lightning_zero.sequence_parallel.exchange import heads_for_positions, positions_for_heads
from lightning_zero.torch_versions.autograd import inside_reentrant_checkpoint

#: The name under which Hugging Face models find the sequence-parallel attention and its (absent) mask.
HF_ATTENTION = "lightning_zero_ulysses"
#: ``id(config)`` -> the attention implementation a wired model's config had, which it runs outside the steps.
_ORIGINAL: dict[int, str] = {}
#: Inside :func:`ulysses_attention`'s own attention call, which :class:`AttentionInterception` must let through (a
#: Hugging Face model's attention reaches it through the interface while the interception is entered too).
_ATTENDING: list[bool] = [False]


def _key_value_heads(tensor: torch.Tensor, size: int, query_heads: int) -> torch.Tensor:
    heads = tensor.shape[1]
    if heads == query_heads or heads % size == 0:
        return tensor
    if size % heads == 0 and query_heads % size == 0:
        return tensor.repeat_interleave(size // heads, dim=1)  # each rank's query heads read one of these
    raise ZeroConfigError(
        f"`sequence_parallel_size={size}`: the attention has {heads} key/value heads, which neither divide by "
        f"{size} nor divide {size}; choose a sequence_parallel_size that divides {heads} or that {heads} divides."
    )


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    sequence: parallel.SequenceParallel,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over the group's whole sequence for ``(B, H, T / k, D)`` inputs."""
    size, group = sequence.size, sequence.group
    if query.dim() != 4:
        raise ZeroConfigError(
            f"`sequence_parallel_size={size}` needs attention inputs shaped (batch, heads, positions, head_dim); "
            f"got a query of shape {tuple(query.shape)}."
        )
    heads = query.shape[1]
    if heads % size:
        raise ZeroConfigError(
            f"`sequence_parallel_size={size}` gives each rank of a group 1/{size} of the attention heads, but the "
            f"attention has {heads} heads; choose a sequence_parallel_size that divides {heads}."
        )
    key, value = (_key_value_heads(t, size, heads) for t in (key, value))
    sequence.exchanges += 1
    query, key, value = (heads_for_positions(t, 1, 2, group, size) for t in (query, key, value))
    _ATTENDING[0] = True
    try:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=key.shape[1] != query.shape[1],
        )
    finally:
        _ATTENDING[0] = False
    return positions_for_heads(out, 1, 2, group, size)


class AttentionInterception(TorchFunctionMode):
    """Every ``F.scaled_dot_product_attention`` call while it is entered runs as :func:`ulysses_attention`."""

    def __init__(self, sequence: parallel.SequenceParallel) -> None:
        super().__init__()
        self.sequence = sequence

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or _ATTENDING[0]:
            return func(*args, **kwargs)
        if not torch.is_grad_enabled() and inside_reentrant_checkpoint():
            raise ZeroConfigError(
                f"`sequence_parallel_size={self.sequence.size}`: this attention runs inside "
                "torch.utils.checkpoint(..., use_reentrant=True), whose recomputation in backward would attend over "
                "this rank's positions only. Checkpoint the blocks with ZeroStrategy(activation_checkpointing=...) "
                "instead, which recomputes them across the group."
            )
        return _sdpa_call(self.sequence, *args, **kwargs)


def _sdpa_call(
    sequence: parallel.SequenceParallel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if attn_mask is not None:
        raise ZeroConfigError(
            f"`sequence_parallel_size={sequence.size}`: F.scaled_dot_product_attention was given an `attn_mask`, "
            "which holds only this rank's positions; under sequence parallelism attention runs over the whole "
            "sequence with `is_causal=True` (or no mask at all), so pass `is_causal` instead of a mask."
        )
    return ulysses_attention(
        query, key, value, sequence=sequence, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-interface signature; returns ``(B, T / k, H, D)`` as its implementations do. Inside a
    step :func:`hf_no_mask` made no mask, so one given was handed to the model whole (4-D) and is refused; outside
    the steps the model's own implementation runs, with the mask its own mask function made."""
    sequence = parallel.active()
    if sequence is None:
        own = _own_attention(module)
        return own(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if attention_mask is not None:
        raise ZeroConfigError(
            f"`sequence_parallel_size={sequence.size}`: the model was handed an attention mask, which holds only this "
            "rank's positions; under sequence parallelism attention is causal over the whole sequence with no mask."
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = ulysses_attention(query, key, value, sequence=sequence, dropout_p=dropout, is_causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def hf_no_mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """The mask function of :data:`HF_ATTENTION`: inside a step attention is causal over the gathered sequence, no
    mask needed; outside the steps, the mask the model's own implementation would make. (The planner's trace uses it
    for models it did not wire: always none.)"""
    if parallel.active() is not None or id(config) not in _ORIGINAL:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    own = _ORIGINAL[id(config)]
    function = ALL_MASK_ATTENTION_FUNCTIONS[own] if own in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask
    return function(*args, config=config, **kwargs)


def _own_attention(module: torch.nn.Module) -> Any:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    own = _ORIGINAL.get(id(getattr(module, "config", None)), "sdpa")
    interface = AttentionInterface()
    return interface[own] if own in interface else sdpa_attention_forward  # "eager" is each model's own function


def remember_implementation(config: Any) -> None:
    _ORIGINAL[id(config)] = config._attn_implementation


def forget_implementation(config: Any) -> None:
    _ORIGINAL.pop(id(config), None)


def register_with_transformers() -> None:
    """Make :data:`HF_ATTENTION` a name Hugging Face models accept (idempotent; only when a model is wired)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION, hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, hf_no_mask)
