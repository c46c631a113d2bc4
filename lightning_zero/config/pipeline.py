"""Checks of the pipeline settings of :class:`~lightning_zero.config.zero_config.ZeroConfig` (a leaf, as ``zero_config.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_zero.config.choices import ZeroConfigError, check_choice

if TYPE_CHECKING:
    from lightning_zero.config.zero_config import ZeroConfig


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
    interleaved = config.pipeline_schedule == "interleaved_1f1b"
    if interleaved and virtual == 1:
        raise ZeroConfigError(
            "`pipeline_schedule='interleaved_1f1b'` runs several stages per rank; set `pipeline_virtual_stages` "
            ">= 2 (or leave it None for 2), or use pipeline_schedule='1f1b'."
        )
    if not interleaved and virtual not in (None, 1):
        raise ZeroConfigError(
            f"`pipeline_virtual_stages={virtual}` needs `pipeline_schedule='interleaved_1f1b'`; "
            f"{config.pipeline_schedule!r} runs one stage per rank."
        )
    if config.pipeline_stages == 1:
        return
    if config.stage == 3:
        raise ZeroConfigError(
            f"`pipeline_stages={config.pipeline_stages}` composes with ZeRO `stage=1` or `stage=2`, not stage=3 (FSDP2 "
            "rooted at each pipeline stage is not implemented). Use stage=2: each rank already holds only its "
            "stage's parameters, with gradients and optimizer state sharded over the replicas."
        )
    if config.state_dict_type == "full":
        raise ZeroConfigError(
            "`state_dict_type='full'` is not available with `pipeline_stages > 1` (each stage's ranks hold only its "
            "layers); use 'sharded' (the default), whose directory loads into a run with or without pipelining, "
            "and `lightning-zero consolidate` for one plain file."
        )
