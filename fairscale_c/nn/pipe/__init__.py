"""fairscale_c.nn.pipe — mirrors fairscale.nn.pipe: Pipe (GPipe in one process), AsyncPipe (one
partition per rank) and PipeRPCWrapper (an AsyncPipe driven from rank 0 over torch RPC), skip
connections (``.skip``) and balance helpers (``.balance``); see
docs/pipe.md.

Beyond FairScale, multi-process pipelines: :class:`PipelineStage` with the schedules
:class:`ScheduleGPipe`, :class:`Schedule1F1B`, :class:`ScheduleInterleaved1F1B` and
:class:`ScheduleLoopedBFS`; see
docs/pipe_stages.md.
"""

from ..checkpoint import is_checkpointing, is_recomputing
from .async_pipe import AsyncPipe
from .pipe import Pipe
from .rpc import PipeRPCWrapper
from .schedule import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    StepStats,
    TensorChunkSpec,
)
from .stage import PipelineStage, TensorMeta
from .types import LazyModule

__all__ = [
    "Pipe",
    "AsyncPipe",
    "PipeRPCWrapper",
    "LazyModule",
    "is_checkpointing",
    "is_recomputing",
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "StepStats",
    "TensorChunkSpec",
    "TensorMeta",
]
