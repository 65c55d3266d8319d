"""Random numbers in a Pipe whose partitions run on threads at once.

Torch's generators are process-wide, so two partitions drawing random numbers concurrently
would make the draws depend on thread timing, and a checkpointed task's recomputation could not
replay what its first pass drew. A Pipe therefore learns which partitions draw (by comparing the
generator states around each task of one run made strictly one after another, FairScale's
order), and from then on runs the tasks of those partitions one at a time in that order — the
clock-cycle order of the GPipe schedule, which FairScale's CPU worker also follows — while the
other partitions run freely. The draws are then those FairScale's Pipe makes under the same
seed, and a recomputation restores the state its task started from (under a lock, restoring the
generators afterwards, so concurrent recomputations do not interleave).

What is learned is kept per setting of the modules' ``training`` flags. A partition that draws
only on some inputs is not reliably detected.
"""

from __future__ import annotations

import threading
from typing import List

import torch

from ...utils.replay import RNGState
from ...utils.replay import capture_rng as capture
from ...utils.replay import restore_rng as restore

__all__ = ["RNGState", "capture", "restore", "same", "replay_lock", "turn_order"]


def same(a: RNGState, b: RNGState) -> bool:
    if not torch.equal(a.cpu, b.cpu):
        return False
    return a.cuda is None or b.cuda is None or torch.equal(a.cuda, b.cuda)


# Recomputations that replay random numbers take this lock: the generators are global.
replay_lock = threading.Lock()


def turn_order(m: int, n: int, ordered: List[bool]) -> dict:
    """Position of each task (micro-batch i, partition j) of an ordered partition in the
    clock-cycle order: cycle i + j, partitions ascending within a cycle."""
    tasks = [(i, j) for i in range(m) for j in range(n) if ordered[j]]
    tasks.sort(key=lambda t: (t[0] + t[1], t[1]))
    return {t: k for k, t in enumerate(tasks)}
