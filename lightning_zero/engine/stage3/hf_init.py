"""Initialising Hugging Face ``transformers`` modules that were built on the meta device.

[Note: Hugging Face initialisation on the meta device]
``transformers`` models initialise through ``PreTrainedModel._init_weights``, not ``reset_parameters``:
``initialize_weights`` visits the module tree children first (``smart_apply``), dispatching each module to the
``_initialize_weights`` of its nearest ``PreTrainedModel``, and ``_init_weights`` also recomputes the buffers an
``__init__`` computed (rotary ``inv_freq``, BERT's ``position_ids``). Under a meta device ``init_weights`` skips the
initialisation and only ties weights, which is what ``configure_model`` leaves us. The stage-3 engine therefore visits
each Hugging Face subtree in that same children-first order, materialises a module, applies the layer's own
``reset_parameters`` (for parameters ``_init_weights`` leaves alone) and then the library's ``_initialize_weights``.

The values differ from an eager build with the same seed: an eager build first draws every layer's constructor
initialisation and redraws them in ``post_init``, while a meta build has no constructor draws to replay (``Conv1D`` has
no ``reset_parameters``), so the random stream is at another offset. Every tensor that is not random equals the eager
build's. Load pretrained weights with ``ZeroStrategy(init_weights=...)``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn


def _pretrained_class() -> type[nn.Module] | None:
    module = sys.modules.get("transformers")
    pretrained: type[nn.Module] | None = getattr(module, "PreTrainedModel", None) if module is not None else None
    return pretrained


def hf_owners(root: nn.Module) -> dict[int, nn.Module]:
    """``id(module)`` -> its nearest ``PreTrainedModel`` ancestor, itself included (``smart_apply``'s dispatch)."""
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
    pretrained: Any = owner  # the library is optional, its methods untyped here
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
