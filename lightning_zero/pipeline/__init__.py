"""Pipeline stages: cutting a model into stages and arranging ranks into pipelines (``split``), running one
pipeline's ``torch.distributed.pipelining`` schedule (``schedule``), and the LightningModule side that
``ZeroStrategy(pipeline_stages=p)`` drives (``parallel``: hooks, placement, process groups, steps).
"""

from lightning_zero.pipeline.parallel import PipelineParallel
from lightning_zero.pipeline.schedule import SCHEDULES, PipelineRunner
from lightning_zero.pipeline.split import PipelineLayout, bubble_fraction, layer_parameters, split_bounds

__all__ = [
    "SCHEDULES",
    "PipelineLayout",
    "PipelineParallel",
    "PipelineRunner",
    "bubble_fraction",
    "layer_parameters",
    "split_bounds",
]
