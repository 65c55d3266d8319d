"""Intra-op threads of CPU partitions that compute at the same time.

Each CPU partition computes on its own worker thread, and each of torch's CPU operators runs a
team of ``torch.get_num_threads()`` threads. Two partitions computing at once would run two
such teams: twice the threads the user asked for, on the cores one team was sized for, with
each team's idle threads spinning while the other's work. So a run shares the caller's thread
count among its CPU partitions that have work: one that is computing or whose input has
arrived. A task started while k partitions have work runs its operators with ``total // k``
threads (at least one); a partition that has the pipeline to itself (filling and draining)
uses them all. Counting arrived inputs, not only running tasks, matters: the partition that
hands an activation on starts its next task before the receiver's thread wakes up.

The count is set per task on the worker's thread alone, through OpenMP's and MKL's per-thread
settings (``omp_set_num_threads`` outside a parallel region, ``MKL_Set_Num_Threads_Local``), not
``torch.set_num_threads``, which also sets the default every other thread takes. Where torch's
CPU library does not export both, nothing is set and the partitions use torch's count.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Callable, Generator, List, Optional, Sequence

import torch

_setters: Optional[List[Callable[[int], object]]] = None
_setters_lock = threading.Lock()


class _Set(threading.local):
    count: Optional[int] = None  # what this thread was last set to; None: never set


_set = _Set()


def _load_setters() -> List[Callable[[int], object]]:
    """The per-thread thread-count setters of the libraries torch's CPU operators use, or none."""
    global _setters
    with _setters_lock:
        if _setters is None:
            found: List[Callable[[int], object]] = []
            try:
                # dlsym on this handle also searches the libraries it links (the OpenMP runtime).
                lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
                omp, mkl = lib.omp_set_num_threads, lib.MKL_Set_Num_Threads_Local  # both take an int
            except (OSError, AttributeError):
                pass
            else:
                omp.argtypes, omp.restype = [ctypes.c_int], None
                mkl.argtypes, mkl.restype = [ctypes.c_int], ctypes.c_int
                found = [omp, mkl]
            _setters = found
        return _setters


class ThreadShare:
    """One pass (forward or backward) of a run: which CPU partitions have work."""

    def __init__(self, cpu: Sequence[bool], total: int, caller: int) -> None:
        self.cpu = list(cpu)  # partitions whose operators run on CPU threads
        self.total = total  # the caller's thread count
        self.caller = caller  # its operators keep the caller's own setting
        self._lock = threading.Lock()
        self._inputs = [0] * len(self.cpu)  # arrived and not yet used up
        self._running = [0] * len(self.cpu)

    def _has_work(self, j: int) -> bool:
        return self.cpu[j] and (self._inputs[j] > 0 or self._running[j] > 0)

    def arrived(self, j: int) -> None:
        """An input of partition `j` is on the board."""
        with self._lock:
            self._inputs[j] += 1

    def used(self, j: int) -> None:
        """Partition `j`'s task for one arrived input has ended."""
        with self._lock:
            self._inputs[j] -= 1

    @contextlib.contextmanager
    def computing(self, j: int) -> Generator[None, None, None]:
        """Around partition `j`'s computation on the current thread."""
        with self._lock:
            self._running[j] += 1
            busy = sum(self._has_work(k) for k in range(len(self.cpu)))  # counts j if on CPU
        try:
            if self.cpu[j] and threading.get_ident() != self.caller:
                _set_threads(max(1, self.total // busy), self.total)
            yield
        finally:
            with self._lock:
                self._running[j] -= 1


def _set_threads(share: int, total: int) -> None:
    """Set this thread's operator threads to `share`; a thread never set and given the whole
    count is left alone (with one thread, always)."""
    if share == (_set.count or total):
        return
    setters = _load_setters()
    if setters:
        torch.get_num_threads()  # torch's first-use setting of this thread comes before ours
        for setter in setters:
            setter(share)
        _set.count = share
