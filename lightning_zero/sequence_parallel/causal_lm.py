"""Hugging Face causal LMs under sequence parallelism, with no change to the user's ``training_step``.

[Note: a Hugging Face causal LM under sequence parallelism]
Each causal LM in the module (a ``transformers`` model whose ``loss_function`` is ``ForCausalLMLoss``) is wired on the
instance, and unwired after ``fit``:

- its config's attention implementation becomes ``"lightning_zero_ulysses"`` (``attention.py``), whose mask function
  builds no mask;
- a forward pre-hook hands the model this rank's global ``position_ids`` (unless given) and, when it is given
  ``labels``, the whole sequence's labels shifted left and cut to this rank (``shift_labels``) with the number of
  tokens that count over the whole batch (``num_items_in_batch``), so the model's loss is this rank's sum over that
  number;
- a forward hook sums that loss over the group (its gradient sums the group's gradients, which ZeRO's average over
  all ranks turns into the data-parallel mean), so the loss a step returns and logs is the group's: the mean over
  every token of the batch. A mixture of experts' load-balancing term (``aux_loss``) is the mean of the ranks' terms,
  each over its own positions: close to, not equal to, the whole sequence's.

Sliding-window, chunked and soft-capped attention, and layers that mix positions otherwise (convolutions, state-space
layers), are refused: the sequence-parallel attention is causal over the whole sequence through
``F.scaled_dot_product_attention``, and everything else sees only a rank's own positions. Outside the strategy's steps
(a callback generating text on one rank) the hooks do nothing and the attention is the model's own, mask included.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.sequence_parallel import parallel
from lightning_zero.sequence_parallel.attention import (
    HF_ATTENTION,
    forget_implementation,
    register_with_transformers,
    remember_implementation,
)
from lightning_zero.sequence_parallel.exchange import group_sum


def is_hf_causal_lm(module: nn.Module) -> bool:
    """A ``transformers`` causal LM (``LlamaForCausalLM``, ``GPT2LMHeadModel``) whose loss is the shifted causal-LM
    loss, told without importing the library. Its inner model (``LlamaModel``) shares its config and is not one."""
    if not type(getattr(module, "config", None)).__module__.startswith("transformers."):
        return False
    if not type(module).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        return False
    return getattr(getattr(module, "loss_function", None), "__name__", None) == "ForCausalLMLoss"


def other_than_causal_attention(config: Any) -> str | None:
    """What in the model mixes positions other than causal attention over the whole sequence, which is all the
    sequence-parallel attention (and the planner's mask skip) can stand for: a sliding window (Mistral's, Gemma's,
    Qwen's when ``use_sliding_window``), chunked attention (Llama 4's), or layers that are not attention at all
    (convolutions, state-space or linear-attention layers: LFM2's, Granite's hybrids). None: there is nothing else."""
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "attention_chunk_size", None) is not None:
        return "chunked attention"
    other = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"})
    if "sliding_attention" in other:
        return "sliding-window attention"
    return f"layers of kind {other[0]!r}" if other else None


def _refusal(model: Any) -> str | None:
    config = model.config
    name = type(model).__name__
    if (other := other_than_causal_attention(config)) is not None:
        return f"{name} uses {other}, which the sequence-parallel attention does not apply across the group"
    if not getattr(model, "_supports_attention_backend", False):
        return (
            f"{name}'s attention does not go through transformers' attention interface (the class is not "
            "`_supports_attention_backend`), so it cannot be exchanged across the group"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"{name} soft-caps its attention logits, which F.scaled_dot_product_attention cannot"
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(type(model).forward).parameters.values())
    if not takes_kwargs:
        return f"{name}.forward takes no **kwargs, so it cannot be handed `shift_labels` and `num_items_in_batch`"
    return None


@dataclasses.dataclass
class _WiredModel:
    """One causal LM's wiring: its hooks and the attention implementation it had."""

    model: Any  # a transformers PreTrainedModel (its config is read and set)
    attention: Any
    handles: list[RemovableHandle]
    #: The call running now was handed this rank's labels, so its loss is summed over the group on the way out.
    labelled: bool = False

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        sequence = parallel.active()
        if sequence is None or sequence.shard is None:
            return None
        shard = sequence.shard
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.shape[1] != shard.local_length:
            raise ZeroConfigError(
                f"`sequence_parallel_size={sequence.size}`: {type(module).__name__} was given {ids.shape[1]} "
                f"positions, but this rank holds {shard.local_length} of the batch's {shard.length}; pass the batch "
                "the step was given (the strategy cuts it)."
            )
        if kwargs.get("position_ids") is None:
            device = ids.device if isinstance(ids, torch.Tensor) else None
            kwargs["position_ids"] = torch.arange(shard.offset, shard.offset + shard.local_length, device=device)[None]
        sequence.positions_given = True
        labels = kwargs.get("labels")
        self.labelled = isinstance(labels, torch.Tensor)
        if not isinstance(labels, torch.Tensor):
            return args, kwargs
        if kwargs.get("num_items_in_batch") is not None:
            raise ZeroConfigError(
                f"`sequence_parallel_size={sequence.size}`: {type(module).__name__} was given `num_items_in_batch`, "
                "which the strategy sets under sequence parallelism (the count over the whole batch, not this rank's "
                "part of it); leave it out."
            )
        if isinstance(given := kwargs.get("shift_labels"), torch.Tensor):
            tokens = shard.shifted_for(given)
            if tokens is None:
                raise ZeroConfigError(
                    f"`sequence_parallel_size={sequence.size}`: {type(module).__name__} was given `shift_labels` that "
                    "are not the batch's `shift_labels` as the strategy cut them; pass the batch's own tensor."
                )
            kwargs["num_items_in_batch"] = tokens.valid.to(labels.device)
            return args, kwargs
        tokens = shard.labels_for(labels)
        if tokens is None:
            raise ZeroConfigError(
                f"`sequence_parallel_size={sequence.size}`: {type(module).__name__} was given `labels` that are neither "
                "the batch's labels nor its input_ids as the strategy cut them (the same tensors, not copies), so the "
                "next token at this rank's last position is unknown. Put the labels in the batch (a dict's `labels`, "
                "or the second element of a tuple), unshifted as Hugging Face takes them, and pass that tensor."
            )
        kwargs["shift_labels"] = tokens.shifted.to(labels.device)
        kwargs["num_items_in_batch"] = tokens.valid.to(labels.device)
        return args, kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        sequence = parallel.active()
        if sequence is None or not self.labelled:
            return None
        self.labelled = False
        if isinstance(output, tuple):  # return_dict=False: the loss first
            return (self._group_loss(output[0], None, sequence), *output[1:])
        loss = getattr(output, "loss", None)
        if loss is not None:
            output.loss = self._group_loss(loss, getattr(output, "aux_loss", None), sequence)
        return output

    def _group_loss(
        self, loss: torch.Tensor, aux_loss: torch.Tensor | None, sequence: parallel.SequenceParallel
    ) -> torch.Tensor:
        if aux_loss is None:
            return group_sum(loss, sequence.group)
        coefficient = getattr(self.model, "router_aux_loss_coef", getattr(self.model, "aux_loss_coef", None))
        if coefficient is None:
            raise ZeroConfigError(
                f"`sequence_parallel_size={sequence.size}`: {type(self.model).__name__} adds a load-balancing loss "
                "with a coefficient under neither `router_aux_loss_coef` nor `aux_loss_coef`, so its term cannot be "
                "averaged over the group; train it with `output_router_logits=False` or without sequence parallelism."
            )
        aux = coefficient * aux_loss.to(loss.device)
        return group_sum(loss - aux, sequence.group) + group_sum(aux, sequence.group) / sequence.size

    def undo(self) -> None:
        for handle in self.handles:
            handle.remove()
        forget_implementation(self.model.config)
        self.model.config._attn_implementation = self.attention  # a dict: each sub-config's own, as it was


def attention_implementations(config: Any) -> dict[str, Any]:
    """The config's attention implementation and each sub-config's, in the form its setter takes back."""
    out = {"": config._attn_implementation}
    for key in getattr(config, "sub_configs", {}) or {}:
        if (sub := getattr(config, key, None)) is not None:
            out[key] = sub._attn_implementation
    return out


class SequenceParallelWiring:
    """The causal LMs wired in one module; :meth:`undo` gives them back as they were."""

    def __init__(self, root: nn.Module, size: int) -> None:
        self.models: list[_WiredModel] = []
        found: list[Any] = [module for module in root.modules() if is_hf_causal_lm(module)]
        for model in found:
            if (why := _refusal(model)) is not None:
                raise ZeroConfigError(f"`sequence_parallel_size={size}` cannot run this model: {why}.")
        if found:
            register_with_transformers()
        for model in found:
            wired = _WiredModel(model, attention_implementations(model.config), [])
            remember_implementation(model.config)
            model.config._attn_implementation = HF_ATTENTION
            wired.handles = [
                model.register_forward_pre_hook(wired.before, with_kwargs=True),
                model.register_forward_hook(wired.after, with_kwargs=True),
            ]
            self.models.append(wired)

    def undo(self) -> None:
        for wired in reversed(self.models):  # a config two models share ends as it began
            wired.undo()
        self.models.clear()
