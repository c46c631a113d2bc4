"""Where a model's layers are cut into pipeline stages, and which ranks form which stage: pure arithmetic.

A pipelined model is a sequence of layers (an ``nn.Sequential`` or a list of modules). Stage ``s`` runs
layers ``bounds[s]:bounds[s + 1]``. With ``virtual`` stages per rank there are ``ranks_per_pipeline * virtual``
stages, assigned as ``torch.distributed.pipelining``'s schedules expect: looped (interleaved 1F1B and zero
bubble), rank ``r`` of a pipeline of ``p`` runs stages ``r, r + p, r + 2p, ...``; V-shaped (ZBV, DualPipeV),
rank ``r`` runs stages ``r`` and ``2p - 1 - r``, so rank 0 holds both the first and the last stage.

Three ways to cut, all checked here, before any process group exists:

* ``"layers"`` (default): the same number of layers per stage, the first stages taking one more when they
  do not divide evenly (as torch's ``pipeline`` splitter does);
* ``"params"``: contiguous stages whose largest parameter count is as small as possible (the optimal
  linear partition, so no stage holds more than it must);
* explicit points: the index (or, for named layers, the name) of the first layer of every stage but the
  first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

from torch import nn

from lightning_zero.config.choices import ZeroConfigError, closest
from lightning_zero.config.zero_config import V_SCHEDULES

if TYPE_CHECKING:
    from lightning_zero.config.zero_config import ZeroConfig

SplitSpec = Union[str, Sequence[int], Sequence[str]]
SPLIT_METHODS = ("layers", "params")


def layer_parameters(layers: Sequence[nn.Module]) -> list[int]:
    """Trainable parameters of each layer (a parameter shared by two layers counts for the first)."""
    seen: set[int] = set()
    counts = []
    for layer in layers:
        count = 0
        for p in layer.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
        counts.append(count)
    return counts


def split_bounds(layers: Sequence[nn.Module] | nn.Sequential, stages: int, how: SplitSpec = "layers") -> list[int]:
    """``stages + 1`` increasing layer indices from 0 to ``len(layers)``: stage ``s`` is ``bounds[s]:bounds[s+1]``.

    Split points may be names when ``layers`` is an ``nn.Sequential`` (its children's names)."""
    names = [name for name, _ in layers.named_children()] if isinstance(layers, nn.Sequential) else None
    layers = list(layers)
    n = len(layers)
    if stages < 1:
        raise ZeroConfigError(f"`pipeline_stages` must be >= 1, got {stages}.")
    if stages > n:
        raise ZeroConfigError(
            f"Cannot cut {n} layers into {stages} pipeline stages: every stage needs at least one layer. "
            f"Use at most {n} stages (pipeline_stages x virtual stages), or expose finer layers."
        )
    if isinstance(how, str):
        if how == "layers":
            return _even_bounds(n, stages)
        if how == "params":
            return _balanced_bounds(layer_parameters(layers), stages)
        raise ZeroConfigError(
            f"`pipeline_split={how!r}` is not supported; choose one of {SPLIT_METHODS} or a list of split points."
            f"{closest(how, SPLIT_METHODS)}"
        )
    return _explicit_bounds(list(how), n, stages, names)


def _even_bounds(n: int, stages: int) -> list[int]:
    size, extra = divmod(n, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + size + (1 if s < extra else 0))
    return bounds


def _balanced_bounds(weights: Sequence[int], stages: int) -> list[int]:
    """The contiguous partition into ``stages`` non-empty parts that minimises the heaviest part (dynamic
    programming over prefix sums; ties go to the earliest cut, so the result is deterministic)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest possible heaviest part when the first i layers form k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _explicit_bounds(points: list, n: int, stages: int, names: list[str] | None) -> list[int]:
    if len(points) != stages - 1:
        raise ZeroConfigError(
            f"`pipeline_split` lists {len(points)} split points for {stages} stages; give {stages - 1}, the first "
            "layer of every stage but the first."
        )
    indices = []
    for point in points:
        if isinstance(point, str):
            if names is None or point not in names:
                raise ZeroConfigError(
                    f"`pipeline_split` names layer {point!r}, which the model does not have."
                    f"{closest(point, names or [])}"
                )
            point = names.index(point)
        elif not isinstance(point, int) or isinstance(point, bool):
            raise ZeroConfigError(f"`pipeline_split` points must be layer indices or names, got {point!r}.")
        indices.append(point)
    bounds = [0, *indices, n]
    if any(not 0 < b < n for b in indices) or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ZeroConfigError(
            f"`pipeline_split={points}` must be strictly increasing layer indices between 1 and {n - 1}, so that "
            "every stage keeps at least one layer."
        )
    return bounds


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Ranks arranged as ``replicas`` data-parallel copies of a pipeline of ``ranks_per_pipeline`` ranks.

    Global rank ``g`` is pipeline rank ``g % p`` of replica ``g // p``: the ranks of one pipeline are
    consecutive (on one node when possible, where their activations travel), and the ranks that hold the
    same stage, one per replica, form its data-parallel (ZeRO) group.
    """

    world_size: int
    ranks_per_pipeline: int
    virtual: int = 1
    v_shape: bool = False
    """Two stages per rank in a V (``r`` and ``2p - 1 - r``) instead of looped (``r`` and ``r + p``)."""

    def __post_init__(self) -> None:
        p, w = self.ranks_per_pipeline, self.world_size
        if p < 1 or self.virtual < 1:
            raise ZeroConfigError(
                f"`pipeline_stages` and the virtual stages per rank must be >= 1, got {p} and {self.virtual}."
            )
        if self.v_shape and self.virtual != 2:
            raise ZeroConfigError(f"A V-shaped pipeline runs exactly 2 stages per rank, got {self.virtual}.")
        if w % p:
            nearest = " or ".join(str(n) for n in (p * (w // p), p * (w // p + 1)) if n)
            raise ZeroConfigError(
                f"{w} processes cannot be divided into pipelines of {p} stages: the number of devices x nodes must "
                f"be a multiple of `pipeline_stages` (e.g. {nearest})."
            )

    @property
    def replicas(self) -> int:
        return self.world_size // self.ranks_per_pipeline

    @property
    def num_stages(self) -> int:
        return self.ranks_per_pipeline * self.virtual

    def pipeline_rank(self, rank: int) -> int:
        return rank % self.ranks_per_pipeline

    def replica(self, rank: int) -> int:
        return rank // self.ranks_per_pipeline

    def stages_of(self, rank: int) -> list[int]:
        """The stage indices ``rank`` runs, in increasing order: one, ``virtual`` looped ones, or a V's two."""
        r, p = self.pipeline_rank(rank), self.ranks_per_pipeline
        if self.v_shape:
            return [r, 2 * p - 1 - r]
        return [r + p * v for v in range(self.virtual)]

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        p = self.ranks_per_pipeline
        return (stage if stage < p else 2 * p - 1 - stage) if self.v_shape else stage % p

    def pipeline_group(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s pipeline, in stage order."""
        start = self.replica(rank) * self.ranks_per_pipeline
        return list(range(start, start + self.ranks_per_pipeline))

    def data_parallel_group(self, rank: int) -> list[int]:
        """The ranks that hold the same stages as ``rank``, one per replica: ZeRO shards across these."""
        return list(range(self.pipeline_rank(rank), self.world_size, self.ranks_per_pipeline))


def pipeline_layout(config: ZeroConfig, world_size: int) -> PipelineLayout:
    """The layout ``config``'s pipeline settings give ``world_size`` processes."""
    return PipelineLayout(
        world_size, config.pipeline_stages, config.pipeline_virtual, config.pipeline_schedule in V_SCHEDULES
    )


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe / 1F1B step with equal stage times: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)
