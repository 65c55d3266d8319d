"""fairscale_c.experimental.nn.distributed_pipeline — mirrors
fairscale.experimental.nn.distributed_pipeline: a pipeline of torch RemoteModules on RPC workers,
laid out as a graph (PipelineModulesGraph), run in micro-batches (DistributedPipeline), with a
loss computed where the output lives (DistributedLoss). See docs/experimental.md."""

from .graph import PipelineModulesGraph
from .loss import DistributedLoss
from .pipeline import DistributedPipeline

__all__ = ["PipelineModulesGraph", "DistributedLoss", "DistributedPipeline"]
