"""fairscale_c.nn.pipe — pipeline parallelism.

Multi-process pipelines: :class:`PipelineStage` with the schedules :class:`ScheduleGPipe`,
:class:`Schedule1F1B` and :class:`ScheduleInterleaved1F1B`; see docs/pipe_stages.md.
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
