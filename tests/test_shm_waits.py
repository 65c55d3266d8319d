"""The shared-memory engine's waiters and the CPUs they run on: a waiter whose peer waits to run on
the waiter's own CPU moves to another CPU it may use, leaves its CPU affinity as it was, and never
moves a thread whose affinity allows one CPU only."""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch

from dist_utils import clean_dev_shm, run_ranks  # noqa: F401  (clean_dev_shm: autouse fixture)

pytestmark = [
    pytest.mark.skipif(
        not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
        reason="needs at least two CPUs this process may run on",
    ),
    pytest.mark.serial,  # which CPU a waiter runs on depends on what else runs
]


ATTEMPTS = 4


def _one_cpu_job(rank, world):
    import fairscale_c.distributed as fdist

    sched_getcpu = ctypes.CDLL(None).sched_getcpu
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    group = fdist.init_group(name="one-cpu")
    sums, masks, cpus = [], [], []
    # The scheduler may still move rank 0 off the shared CPU by itself before it waits there, and
    # then there is nothing to move: a few attempts make a wait on the shared CPU all but certain.
    for _ in range(ATTEMPTS):
        # Both calling threads on one CPU, as the scheduler at times leaves two ranks. Rank 1 stays
        # pinned there; rank 0 may then use every CPU again, but stays where it runs until moved.
        os.sched_setaffinity(0, {first})
        group.barrier()
        if rank == 0:
            os.sched_setaffinity(0, allowed)
        else:
            # Busy on the shared CPU, so that rank 0 arrives first and spins while rank 1 waits to run.
            end = time.perf_counter() + 0.05
            while time.perf_counter() < end:
                pass
        t = torch.full((3,), float(rank + 1))
        group.all_reduce(t)
        sums.append(t.tolist())
        masks.append(os.sched_getaffinity(0))
        cpus.append(sched_getcpu())
    group.destroy()
    return {"sums": sums, "masks": masks, "cpus": cpus}, allowed, first


def test_a_waiter_on_its_peers_cpu_moves_off_it_and_keeps_its_affinity(capfd):
    (r0, allowed, first), (r1, _, _) = run_ranks(
        _one_cpu_job, 2, env={"FAIRSCALE_C_TIMEOUT": "30", "FAIRSCALE_C_DEBUG": "TRACE"}, timeout=120
    )
    assert r0["sums"] == r1["sums"] == [[3.0] * 3] * ATTEMPTS
    assert r0["masks"] == [allowed] * ATTEMPTS, "an op left the calling thread's CPU affinity changed"
    assert r1["masks"] == [{first}] * ATTEMPTS and r1["cpus"] == [first] * ATTEMPTS, "a pinned thread was moved"
    moves = [line for line in capfd.readouterr().err.splitlines() if "moved off CPU" in line]
    assert any(f"rank 0: moved off CPU {first}, on which rank 1 waited to run" in m for m in moves), moves
    assert not any("rank 1: moved" in m for m in moves), moves
