"""Worker threads of a Pipe and the board through which one run's tasks hand values over.

Each partition has one worker thread; a job is a callable run on it. Torch's operators release
the GIL, so partitions on CPU compute concurrently. A run's board holds what tasks hand each
other (activations, gradients, skip tensors) under one condition variable; a wait ends when the
value arrives or when any task of the run has failed, so a failure never leaves a thread
waiting. Waits wake up periodically only to notice a failure recorded from outside.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional

_POLL_S = 0.5


class Aborted(Exception):
    """Raised in a task whose run failed elsewhere; never reaches the caller."""


class Board:
    """Values handed between the tasks of one run, and its first failure."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.slots: Dict[Hashable, Any] = {}
        self.error: Optional[BaseException] = None
        self.jobs_left = 0

    def put(self, key: Hashable, value: Any) -> None:
        with self.cond:
            self.slots[key] = value
            self.cond.notify_all()

    def take(self, key: Hashable) -> Any:
        """Remove and return the value under `key`, waiting for it. Aborted once the run has
        failed, even when the value is there: a failed run starts no more work."""
        with self.cond:
            while self.error is None and key not in self.slots:
                self.cond.wait(_POLL_S)
            if self.error is not None:
                raise Aborted()
            return self.slots.pop(key)

    def wait_until(self, predicate: Callable[[], bool]) -> None:
        with self.cond:
            while self.error is None and not predicate():
                self.cond.wait(_POLL_S)
            if self.error is not None:
                raise Aborted()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    def job(self, body: Callable[[], None]) -> Callable[[], None]:
        """Wrap `body` so that its failure is recorded and its end counted."""
        with self.cond:
            self.jobs_left += 1

        def run() -> None:
            try:
                body()
            except Aborted:
                pass
            except BaseException as exc:  # noqa: B036 - handed to the caller's thread
                self.fail(exc)
            finally:
                with self.cond:
                    self.jobs_left -= 1
                    self.cond.notify_all()

        return run

    def join(self) -> None:
        """Wait for every job of the run to end; then raise the run's failure, if any.

        A KeyboardInterrupt here stops the run's other tasks at their next wait."""
        try:
            with self.cond:
                while self.jobs_left:
                    self.cond.wait(_POLL_S)
        except BaseException as exc:
            self.fail(exc)
            raise
        if self.error is not None:
            raise self.error


class Workers:
    """One daemon thread per partition, started on first use."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.queues: List[queue.SimpleQueue] = []
        self.threads: List[threading.Thread] = []
        self.pid = 0

    def submit(self, index: int, job: Callable[[], None]) -> None:
        if not self.threads or self.pid != os.getpid():  # a forked child has none of the threads
            self.queues, self.threads, self.pid = [], [], os.getpid()
            for j in range(self.count):
                q: queue.SimpleQueue = queue.SimpleQueue()
                t = threading.Thread(target=_loop, args=(q,), name=f"fsc-pipe-{j}", daemon=True)
                t.start()
                self.queues.append(q)
                self.threads.append(t)
        self.queues[index].put(job)

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        self.queues, self.threads = [], []


def _loop(jobs: "queue.SimpleQueue") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job
