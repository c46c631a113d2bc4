"""A batch cut along its sequence: each rank of a sequence-parallel group keeps ``T / k`` consecutive positions.

What is cut: in a dict, every tensor shaped ``(B, T, ...)`` (or ``(1, T, ...)``, a shared ``position_ids``) like its
``input_ids``; in a tuple or list, every such tensor like its first element; a lone ``(B, T)`` tensor. The rest
(scalars, per-sample tensors, strings) is kept whole. What is kept beside it (:class:`SequenceShard`): where this
rank's positions start, and for Hugging Face's convention (labels unshifted, the model shifts) the labels shifted
left over the whole sequence, cut the same way, and how many of the batch's positions count in the loss, so the loss
can be the mean over the whole sample's tokens (``causal_lm.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_zero.config.choices import ZeroConfigError

#: Hugging Face's ignored label.
IGNORE_INDEX = -100

_CONVENTION = (
    "a dict with `input_ids` (and optionally `labels`, `position_ids`, an all-ones `attention_mask`), a tuple or list "
    "`(input_ids, labels, ...)`, or one (batch, positions) tensor"
)


@dataclasses.dataclass(frozen=True)
class NextTokens:
    """What a causal LM handed ``labels`` needs for them: the labels of the whole sequence shifted left by one (the
    next token at each position, -100 at the end), this rank's slice, and how many count over the whole batch."""

    local: torch.Tensor  # this rank's cut of the unshifted labels, as the batch hands it to the step
    shifted: torch.Tensor
    valid: torch.Tensor  # 0-dim

    @classmethod
    def of(cls, labels: torch.Tensor, offset: int, local: int) -> NextTokens:
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
        return cls(
            labels.narrow(1, offset, local).contiguous(),
            shifted.narrow(1, offset, local).contiguous(),
            (shifted != IGNORE_INDEX).sum(),
        )

    @classmethod
    def shifted_already(cls, shift_labels: torch.Tensor, offset: int, local: int) -> NextTokens:
        """A batch's ``shift_labels`` (Hugging Face's and DeepSpeed-Ulysses' pre-shifted labels): cut, not shifted."""
        cut = shift_labels.narrow(1, offset, local).contiguous()
        return cls(cut, cut, (shift_labels != IGNORE_INDEX).sum())


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """This rank's part of one batch's sequence."""

    length: int  # T, the whole sequence
    local_length: int  # T / k
    offset: int  # where this rank's positions start
    #: The batch's labels (a dict's ``labels``, a tuple's second element) and its ``input_ids`` as labels (a step
    #: that passes ``labels=input_ids``), for a causal LM's loss over the whole sequence.
    next_tokens: tuple[NextTokens, ...]

    def labels_for(self, labels: torch.Tensor) -> NextTokens | None:
        """The next tokens of the ``labels`` a step handed the model: the batch's own tensor, as cut. Told by
        identity, never by value: a rank whose part of the labels equals its input ids would otherwise pick another
        source (and another token count) than the rest of its group."""
        return next((tokens for tokens in self.next_tokens if labels is tokens.local), None)

    def shifted_for(self, shift_labels: torch.Tensor) -> NextTokens | None:
        """The batch's own ``shift_labels`` (given whole and shifted by the user), as cut: their count over the
        whole batch."""
        return next((t for t in self.next_tokens if t.shifted is shift_labels and t.local is shift_labels), None)

    def mapped(self, convert: Callable[[torch.Tensor], torch.Tensor]) -> SequenceShard:
        """The same cut with every tensor converted (the planner's fake copies: ``convert`` must map a tensor to the
        same copy each time, as ``FakeTensorMode.from_tensor`` does, so the batch's labels stay the shard's)."""
        tokens = tuple(NextTokens(*(convert(t) for t in (n.local, n.shifted, n.valid))) for n in self.next_tokens)
        return dataclasses.replace(self, next_tokens=tokens)


def sequence_tensor(batch: Any) -> torch.Tensor | None:
    """The tensor whose second dimension is the batch's sequence (its ``input_ids``, or a tuple's first element)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
    elif isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) > 0:
        ids = batch[0]
    else:
        ids = None
    return ids if isinstance(ids, torch.Tensor) else None


def _labels(batch: Any, ids: torch.Tensor) -> torch.Tensor | None:
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, torch.Tensor)) and len(batch) > 1:
        labels = batch[1]
    else:
        labels = None
    return labels if isinstance(labels, torch.Tensor) and labels.shape[:2] == ids.shape[:2] else None


def batch_checksum(ids: torch.Tensor) -> int:
    """A position-weighted sum of ``ids`` (and its shape): equal batches agree, different ones all but never do."""
    flat = ids.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
    return hash((tuple(ids.shape), int((flat * weights).sum()), int(flat.sum())))


def masked_rows(batch: Any) -> str | None:
    """What makes a dict batch's attention more than causal over each whole row: ``"padding"`` (an
    ``attention_mask`` with zeros), ``"packed"`` (``position_ids`` that do not count ``0 .. T-1`` in every row), or
    None. Read from the values: a batch, not a trace's fake copy. In a tuple or list, a tensor shaped like the first
    whose values are 0 and 1 with a 0 among them is taken for a padding mask (the planner then keeps the mask a run
    would build; a tuple batch is never refused for it)."""
    if not isinstance(batch, Mapping):
        ids = sequence_tensor(batch)
        if ids is None or isinstance(batch, torch.Tensor):
            return None
        for value in list(batch)[1:]:
            if isinstance(value, torch.Tensor) and value.shape == ids.shape and not value.is_floating_point():
                if bool(((value == 0) | (value == 1)).all()) and not bool(value.bool().all()):
                    return "padding"
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        return "padding"
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() >= 1:
        length = positions.shape[-1]
        if not bool((positions.reshape(-1, length) == torch.arange(length, device=positions.device)).all()):
            return "packed"
    return None


def _check_whole_rows(batch: Mapping, size: int, length: int) -> None:
    """Attention under sequence parallelism is causal over each whole row with no mask: padding, and samples packed
    into one row (``position_ids`` that restart), would attend to each other, so both are refused."""
    masked = masked_rows(batch)
    if masked == "padding":
        raise ZeroConfigError(
            f"`sequence_parallel_size={size}`: the batch's `attention_mask` has zeros (padding). Attention under "
            "sequence parallelism is causal over the whole row with no mask, so padded positions would be attended "
            "to: give every row a whole sample cut to the batch's length (a multiple of the group size), and no mask."
        )
    if masked == "packed":
        raise ZeroConfigError(
            f"`sequence_parallel_size={size}`: the batch's `position_ids` do not count 0..{length - 1} in every "
            "row (samples packed into one row, or an offset). Attention under sequence parallelism is causal over "
            "the whole row with no mask, so packed samples would attend to each other: give one sample per row."
        )


def split_batch(batch: Any, size: int, rank: int) -> tuple[Any, SequenceShard]:
    """``batch`` with its sequence tensors cut to this rank's ``T / size`` positions, and what the cut kept."""
    ids = sequence_tensor(batch)
    if ids is None or ids.dim() < 2:
        raise ZeroConfigError(
            f"`sequence_parallel_size={size}` cuts each batch along its sequence, so a batch must be {_CONVENTION}; "
            f"got {type(batch).__name__}."
        )
    batch_size, length = ids.shape[:2]
    if length % size:
        raise ZeroConfigError(
            f"`sequence_parallel_size={size}`: the batch's sequence has {length} positions, which do not divide into "
            f"{size} equal parts; pad or cut the sequences to a multiple of {size}."
        )
    if isinstance(batch, Mapping):
        _check_whole_rows(batch, size, length)
    local = length // size
    offset = rank * local

    labels = _labels(batch, ids)
    next_tokens = {id(source): NextTokens.of(source, offset, local) for source in (labels, ids) if source is not None}
    given = batch.get("shift_labels") if isinstance(batch, Mapping) else None
    if isinstance(given, torch.Tensor) and given.shape[:2] == ids.shape[:2]:  # labels the user shifted already
        next_tokens[id(given)] = NextTokens.shifted_already(given, offset, local)

    def cut(value: Any) -> Any:
        if id(value) in next_tokens:  # the same tensor the step hands the model as labels
            return next_tokens[id(value)].local
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            if value.shape[0] in (batch_size, 1):
                return value.narrow(1, offset, local).contiguous()
        return value

    if isinstance(batch, torch.Tensor):
        out: Any = cut(batch)
    elif isinstance(batch, Mapping):
        out = type(batch)({key: cut(value) for key, value in batch.items()})  # type: ignore[call-arg]
    elif hasattr(batch, "_fields"):  # a named tuple
        out = type(batch)(*(cut(value) for value in batch))
    else:
        out = type(batch)(cut(value) for value in batch)
    return out, SequenceShard(length, local, offset, tuple(next_tokens.values()))
