"""Where stashed skip tensors wait for their pop: a tracker per thread.

Outside a Pipe (or between layers of one partition) the default tracker keeps the tensor in a
dict. Inside a Pipe, the pipeline installs its own tracker for each task (see pipeline.py), which
carries tensors whose stash and pop sit in different partitions across the boundary.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Generator, Optional, Tuple

from torch import Tensor

from .namespace import Namespace

Key = Tuple[Namespace, str]


class SkipTracker:
    """Keeps stashed tensors until they are popped, on one thread."""

    def __init__(self) -> None:
        self.tensors: Dict[Key, Optional[Tensor]] = {}

    @property
    def index(self) -> int:
        """The micro-batch this tracker serves (0 outside a Pipe)."""
        return 0

    def save(self, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, ns: Namespace, name: str) -> Optional[Tensor]:
        return self.tensors.pop((ns, name))


class _Local(threading.local):
    def __init__(self) -> None:
        self.tracker: Optional[SkipTracker] = None


_local = _Local()


@contextlib.contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Generator[None, None, None]:
    """Make `tracker` this thread's tracker while inside."""
    before = _local.tracker
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = before


def current_skip_tracker() -> SkipTracker:
    """This thread's tracker (a plain one is created on first use)."""
    if _local.tracker is None:
        _local.tracker = SkipTracker()
    return _local.tracker
