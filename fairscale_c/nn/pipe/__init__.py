"""fairscale_c.nn.pipe — pipeline parallelism.

Multi-process pipelines (one stage per rank): :class:`PipelineStage` with the schedules
:class:`ScheduleGPipe` and :class:`Schedule1F1B`; see docs/pipe_stages.md.
"""

from .schedule import PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, StepStats
from .stage import PipelineStage, TensorMeta

__all__ = [
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "StepStats",
    "TensorMeta",
]
