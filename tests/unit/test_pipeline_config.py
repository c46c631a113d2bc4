"""Pipeline settings of ZeroStrategy: every bad value fails when the strategy (or the Trainer) is built, in
the main process, before any process group or child process exists."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_zero import ZeroConfigError, ZeroStrategy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pipeline_stages=2, state_dict_type="full"), "`state_dict_type='full'` is not available"),
        (
            dict(pipeline_stages=2, pipeline_schedule="zero_bubble"),
            "choose one of ('gpipe', '1f1b', 'interleaved_1f1b', 'interleaved_zb', 'zbv', 'dualpipev')",
        ),
        (dict(pipeline_stages=2, pipeline_schedule="zbv1"), "Did you mean 'zbv'?"),
        (dict(pipeline_stages=2, pipeline_schedule="interleaved_zb", pipeline_virtual_stages=1), ">= 2"),
        (dict(pipeline_stages=2, pipeline_schedule="zbv", pipeline_virtual_stages=3), "runs exactly 2 stages per rank"),
        (
            dict(pipeline_stages=2, pipeline_schedule="dualpipev", microbatches=3),
            "at least as many micro-batches as stages (4",
        ),
        (dict(stage=3, pipeline_stages=2, shard_size=2), "would need a 3-D mesh"),
        (dict(stage=3, pipeline_stages=2, secondary_shard_size=2), "`secondary_shard_size=2` is not supported"),
        (dict(pipeline_stages=2, pipeline_schedule="1fb1"), "Did you mean '1f1b'?"),
        (dict(pipeline_stages=2, pipeline_split="parms"), "Did you mean 'params'?"),
        (dict(pipeline_stages=2, pipeline_split=[1.5]), "list of layer indices or names"),
        (dict(pipeline_stages=2, pipeline_schedule="interleaved_1f1b", pipeline_virtual_stages=1), ">= 2"),
        (dict(pipeline_stages=2, pipeline_virtual_stages=2), "needs a schedule with several stages per rank"),
        (dict(pipeline_stages=0), "`pipeline_stages` must be an integer >= 1"),
        (dict(pipeline_stages=2, microbatches=0), "`microbatches` must be None or an integer >= 1"),
    ],
)
def test_bad_pipeline_settings_fail_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ZeroConfigError) as err:
        ZeroStrategy(**kwargs)
    assert message in str(err.value)


def test_devices_not_divisible_by_stages_fail_when_the_trainer_is_built():
    with pytest.raises(
        ZeroConfigError, match=r"3 processes cannot be divided into pipelines of 2 stages.*\(e\.g\. 2 or 4\)"
    ):
        L.Trainer(accelerator="cpu", devices=3, strategy=ZeroStrategy(stage=1, pipeline_stages=2), logger=False)
    # Fewer processes than stages: one multiple to suggest, said once.
    with pytest.raises(
        ZeroConfigError, match=r"2 processes cannot be divided into pipelines of 3 stages.*\(e\.g\. 3\)\."
    ):
        L.Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=1, pipeline_stages=3), logger=False)


def test_defaults_one_microbatch_per_stage_and_two_virtual_stages_when_interleaved():
    config = ZeroStrategy(pipeline_stages=4).zero_config
    assert (config.pipeline_microbatches, config.pipeline_virtual) == (4, 1)
    config = ZeroStrategy(pipeline_stages=2, pipeline_schedule="interleaved_1f1b").zero_config
    assert (config.pipeline_microbatches, config.pipeline_virtual) == (4, 2)
    assert ZeroStrategy(pipeline_stages=2, microbatches=8).zero_config.pipeline_microbatches == 8
    for schedule in ("zbv", "dualpipev"):  # two stages per rank in a V
        config = ZeroStrategy(stage=3, pipeline_stages=2, pipeline_schedule=schedule).zero_config
        assert (config.pipeline_microbatches, config.pipeline_virtual) == (4, 2)
    assert ZeroStrategy(pipeline_stages=3, pipeline_schedule="interleaved_zb").zero_config.pipeline_virtual == 2
