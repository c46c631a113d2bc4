"""``ZeroStrategy(tiled_compute=True)``: the MLPs and the LM head with the loss of a Hugging Face causal LM computed in
sequence tiles, with no change to the model's code or the user's ``training_step``.

[Note: tiling a Hugging Face causal LM]
Every decoder layer's MLP (the module a layer holds as ``mlp``) gets an instance ``forward`` that runs its own forward
through :func:`tiled_forward`. A mixture of experts held as ``mlp`` (one that holds ``experts``) returns router logits
beside its output and is left whole.

The causal LM gets an instance ``forward`` too. When it is given ``labels`` with grad enabled (a training step), it
calls its own forward without them (so a mixture of experts' load-balancing loss, which the model adds only given
labels, is added here: ``router_aux_loss_coef`` times the output's ``aux_loss``), while its ``lm_head`` keeps its input and hands back a zero-stride placeholder
instead of logits. The loss is then :func:`tiled_cross_entropy` of that input, as Hugging Face's ``ForCausalLMLoss``
computes it: labels shifted left by one (or the ``shift_labels`` given), the mean over the positions that count, or
the sum over ``num_items_in_batch`` when given. The output's ``loss`` is that loss and its ``logits`` is None: the
whole logits never exist. Without labels, or without grad (validation, generation), the model runs as written.

A head whose logits are transformed after ``lm_head`` (soft-capping, a scale), or whose loss is not Hugging Face's
shifted ``ForCausalLMLoss`` (BART-style causal LMs take labels unshifted), stays whole, with a message: the model's
``forward`` is read for it (``_head_left_whole``). Everything is undone after ``fit``, as activation checkpointing's wrapping is: no class or torch
function is patched.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_zero.tiled_compute.tiles import tiled_cross_entropy, tiled_forward

#: Words in a causal LM's ``forward`` that transform the logits after ``lm_head`` (soft-capping, scaling): a head
#: whose forward holds one stays whole.
_TRANSFORMED_LOGITS = ("softcap", "soft_cap", "logit_scale", "logits_scaling", "output_multiplier")


def _head_left_whole(model: nn.Module) -> str | None:
    """Why the head and loss of ``model`` cannot be tiled as Hugging Face's ``ForCausalLMLoss`` (None: they can).
    Only a forward that computes its loss through ``self.loss_function`` with the shifted causal-LM loss, and does
    nothing to the logits between ``lm_head`` and it, is tiled: BART-style causal LMs take labels unshifted, and
    Gemma's and RecurrentGemma's cap their logits."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return "its forward's source cannot be read"
    if "self.loss_function(" not in source:
        return "it computes its loss itself, not through Hugging Face's loss_function"
    loss = getattr(getattr(model, "loss_function", None), "__name__", None)
    if loss != "ForCausalLMLoss":
        return f"its loss is {loss}, not ForCausalLMLoss"
    transformed = [word for word in _TRANSFORMED_LOGITS if word in source]
    return f"its logits are transformed after lm_head ({transformed[0]})" if transformed else None


def _is_causal_lm(module: nn.Module) -> bool:
    """A Hugging Face causal LM (told without importing the library): a ``transformers`` config, a linear head, and
    the library's name for the class (``LlamaForCausalLM``, ``GPT2LMHeadModel``)."""
    return (
        type(getattr(module, "config", None)).__module__.startswith("transformers.")
        and type(module).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        and isinstance(getattr(module, "lm_head", None), nn.Linear)
    )


class TiledMLP:
    """An MLP's instance ``forward``: its own forward, a tile of positions at a time."""

    def __init__(self, forward: Callable[..., torch.Tensor], tile_size: int) -> None:
        self.forward = forward
        self.tile_size = tile_size

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tiled_forward(self.forward, hidden, *args, tile_size=self.tile_size, **kwargs)


class CapturedHead:
    """``lm_head``'s instance ``forward``: while a tiled loss is pending, it keeps its input and returns a zero-stride
    placeholder of the logits' shape (no memory); otherwise its own forward."""

    def __init__(self, head: nn.Linear) -> None:
        self.module = head
        self.head_forward = head.forward
        self.out_features = head.out_features
        self.pending = False
        self.hidden: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.pending:
            return self.head_forward(hidden)
        self.hidden = hidden
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], self.out_features)


class TiledLoss:
    """A causal LM's instance ``forward``: with labels in a training step, the loss from the head's input in tiles
    ([Note: tiling a Hugging Face causal LM])."""

    def __init__(self, model: nn.Module, head: CapturedHead, tile_size: int | None) -> None:
        self.forward = model.forward
        self.signature = inspect.signature(self.forward)
        self.model = model
        self.head = head
        self.tile_size = tile_size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind_partial(*args, **kwargs)
        labels = bound.arguments.get("labels")
        extra = bound.arguments.get("kwargs", {})
        untiled = (
            not torch.is_grad_enabled()
            or bound.arguments.get("logits_to_keep", 0) not in (0, None)
            or bound.arguments.get("return_dict", extra.get("return_dict")) is False  # a tuple: no loss to set
        )
        if untiled or labels is None:
            return self.forward(*args, **kwargs)
        num_items = extra.pop("num_items_in_batch", None)
        shift_labels = extra.pop("shift_labels", None)
        ignore_index = extra.pop("ignore_index", -100)
        bound.arguments["labels"] = None
        self.head.pending = True
        try:
            output = self.forward(*bound.args, **bound.kwargs)
            hidden = self.head.hidden
        finally:
            self.head.pending, self.head.hidden = False, None
        if hidden is None:
            raise RuntimeError(
                f"tiled_compute: {type(self.model).__name__}'s forward did not call its lm_head; run it with "
                "tiled_compute=False."
            )
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        weight, bias = self.head.module.weight, self.head.module.bias
        reduction = "sum" if num_items is not None else "mean"
        loss = tiled_cross_entropy(
            hidden, weight, shift_labels, bias, tile_size=self.tile_size, ignore_index=ignore_index, reduction=reduction
        )
        if num_items is not None:
            loss = loss / num_items.to(loss.device) if isinstance(num_items, torch.Tensor) else loss / num_items
        aux_loss = getattr(output, "aux_loss", None)
        if aux_loss is not None:  # a mixture of experts' load balancing, which it adds to the loss given labels
            coefficient = getattr(self.model, "router_aux_loss_coef", getattr(self.model, "aux_loss_coef", None))
            if coefficient is None:
                raise RuntimeError(
                    f"tiled_compute: {type(self.model).__name__} returned an auxiliary loss whose coefficient is "
                    "neither `router_aux_loss_coef` nor `aux_loss_coef`; train it with tiled_compute=False."
                )
            loss = loss + coefficient * aux_loss.to(loss.device)
        fields = {key: value for key, value in output.items() if key != "logits"}
        return type(output)(**{**fields, "loss": loss})  # keyed and indexed as the library's: loss first, no logits


@dataclasses.dataclass
class TilingUndone:
    """Removes the instance ``forward`` attributes :func:`apply_tiled_compute` set (a plain object: the strategy that
    holds it is pickled by the ``spawn`` start method)."""

    modules: list[nn.Module]

    def __call__(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)


def apply_tiled_compute(root: nn.Module, tile_size: int | None) -> TilingUndone:
    """Tile the MLPs and the LM head with the loss of every Hugging Face causal LM in ``root`` ([Note: tiling a
    Hugging Face causal LM]); ``tile_size`` positions per tile, or None: the model's hidden size for the MLPs (ALST's
    choice) and :data:`LOSS_TILE_ELEMENTS` logits for the loss. Returns what undoes it."""
    models = [m for m in root.modules() if _is_causal_lm(m)]
    if not models:
        rank_zero_warn(
            f"tiled_compute=True found no Hugging Face causal LM (a `...ForCausalLM` with an `lm_head`) in "
            f"{type(root).__name__}; nothing is tiled. In your own module, call lightning_zero.tiled_forward for the "
            "MLP and lightning_zero.tiled_cross_entropy for the head and the loss."
        )
    wrapped: list[nn.Module] = []
    for model in models:
        if "forward" in model.__dict__:  # tiled already (a second fit)
            continue
        mlp_tile = tile_size if tile_size is not None else int(getattr(model.config, "hidden_size", 1024))
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] == "mlp" and not hasattr(module, "experts") and "forward" not in module.__dict__:
                module.forward = TiledMLP(module.forward, mlp_tile)
                wrapped.append(module)
        reason = _head_left_whole(model)
        if reason is not None:
            rank_zero_info(
                f"tiled_compute: {type(model).__name__}'s head and loss are computed whole ({reason}); its MLPs in "
                "tiles."
            )
            continue
        lm_head = cast(nn.Linear, model.lm_head)  # a Linear: _is_causal_lm
        head = CapturedHead(lm_head)
        lm_head.forward = head  # type: ignore[method-assign, assignment]
        model.forward = TiledLoss(model, head, tile_size)
        wrapped += [lm_head, model]
    return TilingUndone(wrapped)
