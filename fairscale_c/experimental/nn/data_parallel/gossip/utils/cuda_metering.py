"""Timing named sections of a training step: CUDA events where CUDA is available, the host clock
otherwise, with per-name statistics over the last 10,000 occurrences."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from functools import partial
from typing import Any, ClassVar, Deque, Dict, Optional

import torch

MAX_LEN_DEQUEUE = 10**4
deque_with_max_len_fixed = partial(deque, maxlen=MAX_LEN_DEQUEUE)


def create_and_record_event() -> "torch.cuda.Event":
    """A timing CUDA event recorded on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class EventRecorder:
    """A section being timed; :meth:`stop` ends it."""

    def stop(self) -> None:
        pass


class _HostMark:
    """The host clock's stand-in for a CUDA event on a machine without CUDA."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostMark") -> float:
        return (end.t - self.t) * 1e3


def _mark() -> Any:
    return create_and_record_event() if torch.cuda.is_available() else _HostMark()


class CudaEventRecorder(EventRecorder):
    """Times the work between its creation and :meth:`stop` under ``event_name`` (milliseconds:
    CUDA events on the current stream, or the host clock without CUDA). :meth:`get_timings` gives
    the mean, standard deviation and count of each name since :meth:`reset`;
    :meth:`get_all_timings` since the start."""

    event_recorders: ClassVar[Dict[str, Deque["CudaEventRecorder"]]] = defaultdict(deque_with_max_len_fixed)
    all_event_recorders: ClassVar[Dict[str, Deque["CudaEventRecorder"]]] = defaultdict(deque_with_max_len_fixed)

    def __init__(self, event_name: str) -> None:
        self.event_name = event_name
        self.start_event = _mark()
        self.end_event: Optional[Any] = None
        CudaEventRecorder.event_recorders[event_name].append(self)
        CudaEventRecorder.all_event_recorders[event_name].append(self)

    def stop(self) -> None:
        self.end_event = _mark()

    def find_time_elapsed(self) -> float:
        if self.end_event is None:
            raise RuntimeError(f"CudaEventRecorder: stop() was not called for the event named {self.event_name!r}")
        self.end_event.synchronize()
        return self.start_event.elapsed_time(self.end_event)

    @classmethod
    def reset(cls) -> None:
        cls.event_recorders = defaultdict(deque_with_max_len_fixed)

    @classmethod
    def get_common_timings(cls, event_recorders: Dict[str, Deque["CudaEventRecorder"]], description: str) -> str:
        lines = [f"{description}:"]
        for name, recorders in event_recorders.items():
            times = [r.find_time_elapsed() for r in recorders]
            lines.append(
                f"{name}: Time taken: avg: {statistics.mean(times)}, std: {statistics.pstdev(times)}, "
                f"count: {len(times)}"
            )
        return "\n".join(lines) + "\n"

    @classmethod
    def get_timings(cls) -> str:
        """The timings since the last :meth:`reset`."""
        return cls.get_common_timings(cls.event_recorders, "Timings since last reset")

    @classmethod
    def get_all_timings(cls) -> str:
        """The timings of every recorded occurrence (the last 10,000 of each name)."""
        return cls.get_common_timings(cls.all_event_recorders, "All timings")


class DummyCudaEventRecorder(EventRecorder):
    """A recorder that records nothing (profiling off)."""


def create_event_recorder(event_name: str, dummy: bool = False) -> EventRecorder:
    return DummyCudaEventRecorder() if dummy else CudaEventRecorder(event_name)
