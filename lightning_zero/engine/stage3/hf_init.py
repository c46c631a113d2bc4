"""Initialising Hugging Face ``transformers`` modules that were built on the meta device.

[Note: Hugging Face initialisation on the meta device]
``transformers`` models initialise through ``PreTrainedModel._init_weights`` (``post_init`` -> ``init_weights``
-> ``initialize_weights``), not ``reset_parameters``: ``initialize_weights`` visits the module tree children
first (``smart_apply``), dispatching each module to the ``_initialize_weights`` of its nearest
``PreTrainedModel`` (composite models nest several), and ``_init_weights`` also recomputes the buffers an
``__init__`` computed (rotary ``inv_freq``, BERT's ``position_ids``). Under a meta device ``init_weights`` skips
the initialisation and only ties weights, which is what ``configure_model`` leaves us. The stage-3 engine then
visits each Hugging Face subtree in that same children-first order, materialises a module, applies the layer's
own ``reset_parameters`` (if any, for parameters ``_init_weights`` leaves alone) and then the library's
``_initialize_weights``, so every tensor gets the library's initialisation and distribution.

Not the same values as an eager CPU build with the same seed: an eager build first draws every layer's
constructor initialisation (``nn.Linear.reset_parameters``, ``Conv1D``'s ``normal_`` inside its ``__init__``)
and only then redraws them in ``post_init``; a meta build has no constructor draws to replay (``Conv1D`` has no
``reset_parameters``), so the random stream is at another offset. Every tensor that is not random (norms,
biases, zeroed padding rows, rotary and position buffers) equals the eager build's. A tied parameter (GPT-2's
``lm_head.weight`` is ``wte.weight``) stays one parameter, drawn from the same distribution by each of its
owners in turn. Load pretrained weights with ``ZeroStrategy(init_weights=...)``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn


def _pretrained_class() -> type[nn.Module] | None:
    """``transformers.PreTrainedModel`` if the library is loaded (a model built from it imported it), else None."""
    module = sys.modules.get("transformers")
    pretrained: type[nn.Module] | None = getattr(module, "PreTrainedModel", None) if module is not None else None
    return pretrained


def hf_owners(root: nn.Module) -> dict[int, nn.Module]:
    """``id(module)`` -> the ``PreTrainedModel`` whose ``_initialize_weights`` initialises it: its nearest
    ``PreTrainedModel`` ancestor, itself included (``smart_apply``'s dispatch). Empty without ``transformers``."""
    pretrained = _pretrained_class()
    owners: dict[int, nn.Module] = {}
    if pretrained is None:
        return owners

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        if isinstance(module, pretrained):
            owner = module
        if owner is not None:
            owners.setdefault(id(module), owner)
        for child in module.children():
            visit(child, owner)

    visit(root, None)
    return owners


def initialize(module: nn.Module, owner: nn.Module) -> None:
    """Apply the library's initialisation to ``module`` (its own tensors, freshly materialised)."""
    pretrained: Any = owner  # a ``transformers.PreTrainedModel``: the library is optional, its methods untyped here
    guard = contextlib.nullcontext()
    initialization = sys.modules.get("transformers.initialization")
    if initialization is not None and hasattr(initialization, "guard_torch_init_functions"):
        guard = initialization.guard_torch_init_functions()
    module.__dict__.pop("_is_hf_initialized", None)  # a previous materialisation of this module set it
    with torch.no_grad(), guard:
        if hasattr(pretrained, "is_custom_code"):  # transformers 5: whether the model's code came with its weights
            pretrained._initialize_weights(module, pretrained.is_custom_code())
        else:  # transformers 4
            pretrained._initialize_weights(module)
