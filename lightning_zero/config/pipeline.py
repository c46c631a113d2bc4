"""Checks of the pipeline settings of :class:`~lightning_zero.config.zero_config.ZeroConfig` (a leaf, as ``zero_config.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_zero.config.choices import ZeroConfigError, check_choice

if TYPE_CHECKING:
    from lightning_zero.config.zero_config import ZeroConfig

#: Every ``pipeline_schedule`` (``pipeline/schedule.py`` maps each to its ``torch.distributed.pipelining`` class).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
#: Several stages per rank, rank ``r`` of ``p`` running stages ``r, r + p, r + 2p, ...`` (``pipeline_virtual_stages``).
LOOPED_SCHEDULES = ("interleaved_1f1b", "interleaved_zb")
#: Exactly two stages per rank in a V: rank ``r`` of ``p`` runs stages ``r`` and ``2p - 1 - r``, so the first and the
#: last stage share rank 0.
V_SCHEDULES = ("zbv", "dualpipev")

#: Why ``shard_size`` / ``secondary_shard_size`` do not combine with pipeline stages.
PIPELINE_HYBRID_REFUSAL = (
    "each stage is already sharded over its data-parallel ranks only (one per pipeline replica), and sharding those "
    "again in groups would need a 3-D mesh (pipeline x replicate x shard) that is not implemented. Drop one of the two "
    "settings (more pipeline stages also shrink each stage's data-parallel group, and what crosses nodes)."
)


def virtual_stages(schedule: str, virtual: int | None) -> int:
    """Stages per rank: ``virtual`` for a looped schedule (2 unless set), 2 for a V, else 1."""
    if schedule in LOOPED_SCHEDULES:
        return 2 if virtual is None else virtual
    return 2 if schedule in V_SCHEDULES else 1


def check_pipeline(config: ZeroConfig) -> None:
    """The pipeline settings of a ``ZeroConfig`` (``config``), and how they combine with the stage and the checkpoint
    format."""
    split = config.pipeline_split
    if isinstance(split, str):
        check_choice("pipeline_split", split, ("layers", "params"))
    elif not isinstance(split, (list, tuple)) or not all(
        isinstance(x, (int, str)) and not isinstance(x, bool) for x in split
    ):
        raise ZeroConfigError(
            f"`pipeline_split` must be 'layers', 'params' or a list of layer indices or names, got {split!r}."
        )
    virtual = config.pipeline_virtual_stages
    if virtual is not None and (not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1):
        raise ZeroConfigError(f"`pipeline_virtual_stages` must be None or an integer >= 1, got {virtual!r}.")
    schedule = config.pipeline_schedule
    if schedule in LOOPED_SCHEDULES and virtual == 1:
        raise ZeroConfigError(
            f"`pipeline_schedule={schedule!r}` runs several stages per rank; set `pipeline_virtual_stages` "
            ">= 2 (or leave it None for 2), or use pipeline_schedule='1f1b'."
        )
    if schedule in V_SCHEDULES and virtual not in (None, 2):
        raise ZeroConfigError(
            f"`pipeline_schedule={schedule!r}` runs exactly 2 stages per rank (a V: rank r holds stages r and "
            f"2p-1-r); leave `pipeline_virtual_stages` None (or 2), got {virtual}."
        )
    if schedule not in (*LOOPED_SCHEDULES, *V_SCHEDULES) and virtual not in (None, 1):
        raise ZeroConfigError(
            f"`pipeline_virtual_stages={virtual}` needs a schedule with several stages per rank "
            f"({', '.join(repr(s) for s in (*LOOPED_SCHEDULES, *V_SCHEDULES))}); {schedule!r} runs one stage per rank."
        )
    stages = config.pipeline_stages * virtual_stages(schedule, virtual)
    if schedule == "dualpipev" and config.microbatches is not None and config.microbatches < stages:
        raise ZeroConfigError(
            f"`pipeline_schedule='dualpipev'` needs at least as many micro-batches as stages ({stages} = 2 x "
            f"pipeline_stages); got `microbatches={config.microbatches}`."
        )
    if config.pipeline_stages == 1:
        return
    if config.state_dict_type == "full":
        raise ZeroConfigError(
            "`state_dict_type='full'` is not available with `pipeline_stages > 1` (each stage's ranks hold only its "
            "layers); use 'sharded' (the default), whose directory loads into a run with or without pipelining, "
            "and `lightning-zero consolidate` for one plain file."
        )
