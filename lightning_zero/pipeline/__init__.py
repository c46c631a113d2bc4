"""Pipeline stages: cutting a model into stages and arranging ranks into pipelines (``split``).

Running ``torch.distributed.pipelining`` schedules inside ``ZeroStrategy`` is issue 7's remaining work;
until then ``ZeroStrategy(pipeline_stages>1)`` is refused with a clear error.
"""

from lightning_zero.pipeline.split import PipelineLayout, bubble_fraction, layer_parameters, split_bounds

__all__ = ["PipelineLayout", "bubble_fraction", "layer_parameters", "split_bounds"]
