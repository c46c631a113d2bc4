"""Pipeline stages: cutting a model into stages and arranging ranks into pipelines (``split``), and
running one pipeline's ``torch.distributed.pipelining`` schedule (``schedule``).

Wiring them into ``ZeroStrategy`` (training_step, ZeRO over each stage's data-parallel group, logging,
checkpoints) is issue 7's remaining work; until then ``ZeroStrategy(pipeline_stages>1)`` is refused with a
clear error.
"""

from lightning_zero.pipeline.schedule import SCHEDULES, PipelineRunner
from lightning_zero.pipeline.split import PipelineLayout, bubble_fraction, layer_parameters, split_bounds

__all__ = ["SCHEDULES", "PipelineLayout", "PipelineRunner", "bubble_fraction", "layer_parameters", "split_bounds"]
