"""A randomised schedule of collectives on the shm engine: every rank draws the same sequence of
ops (kind, dtype, size, root, reduction, sync or async) from one seed, with up to four async ops
in flight at once and waits deferred behind later ops, so ops of very different sizes interleave
in the engine's slots. Every result is checked against a torch reference that each rank computes
from the other ranks' (seeded) inputs. A protocol slip (a slot reused too early, a result written
to the wrong op, a lost wake-up) shows up as a wrong value or a timeout, not as a hang."""

from __future__ import annotations

import random

import pytest
import torch

from dist_utils import run_ranks, orphaned_segments
from test_collectives import _check, _data, _reference

# Sizes straddle the 1 MiB pipeline chunk for every dtype (262144 float32 elements per chunk).
SIZES = [1, 7, 1000, 65_537, 262_144, 262_145, 700_001]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64]
KINDS = ["all_reduce", "all_gather", "all_gather_inplace", "reduce_scatter", "broadcast", "reduce", "ring", "barrier"]
STEPS = 120
MAX_IN_FLIGHT = 4


@pytest.fixture(autouse=True)
def clean_dev_shm():
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


def _schedule(seed: int, world: int):
    rng = random.Random(seed)
    for step in range(STEPS):
        kind = rng.choice(KINDS)
        dtype = rng.choice(DTYPES)
        op = rng.choice(["sum", "avg", "max", "min"] if dtype.is_floating_point else ["sum", "max", "min"])
        n = rng.choice(SIZES)
        yield step, kind, dtype, op, n, rng.randrange(world), rng.random() < 0.6


def _issue(group, rank, world, step, kind, dtype, op, n, root, async_op):
    """Start one op; returns (work or None, a check(failures) callable)."""
    inputs = [_data(r, n, dtype, step) for r in range(world)]
    mine = inputs[rank].clone()
    if kind == "all_reduce":
        work = group.all_reduce(mine, op=op, async_op=async_op)
        return work, lambda f: _check(mine, _reference(inputs, op, dtype), f"{step}: all_reduce {op}", f)
    if kind in ("all_gather", "all_gather_inplace"):
        out = torch.empty(n * world, dtype=dtype)
        src = mine
        if kind == "all_gather_inplace":
            out[rank * n : (rank + 1) * n] = mine
            src = out[rank * n : (rank + 1) * n]
        work = group.all_gather(out, src, async_op=async_op)
        return work, lambda f: _check(out, torch.cat(inputs), f"{step}: {kind}", f)
    if kind == "reduce_scatter":
        full = [_data(r, n * world, dtype, step) for r in range(world)]
        out = torch.empty(n, dtype=dtype)
        work = group.reduce_scatter(out, full[rank].clone(), op=op, async_op=async_op)
        want = _reference(full, op, dtype)[rank * n : (rank + 1) * n]
        return work, lambda f: _check(out, want, f"{step}: reduce_scatter {op}", f)
    if kind == "broadcast":
        work = group.broadcast(mine, root, async_op=async_op)
        return work, lambda f: _check(mine, inputs[root], f"{step}: broadcast from {root}", f)
    if kind == "reduce":
        work = group.reduce(mine, root, op=op, async_op=async_op)
        want = _reference(inputs, op, dtype) if rank == root else inputs[rank]
        return work, lambda f: _check(mine, want, f"{step}: reduce {op} to {root}", f)
    if kind == "ring":  # to the next rank, from the previous one; rank 0 sends first, the rest receive first
        got = torch.empty(n, dtype=dtype)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        if rank == 0:
            group.send(mine, nxt)
            group.recv(got, prv)
        else:
            group.recv(got, prv)
            group.send(mine, nxt)
        return None, lambda f: _check(got, inputs[prv], f"{step}: ring", f)
    work = group.barrier(async_op=async_op)
    return work, lambda f: None


def _stress_job(rank, world, seed):
    import fairscale_c.distributed as fdist

    failures = []
    pending = []  # (work, check) in issue order
    with fdist.init_group(name=f"stress-{seed}") as group:
        for step, kind, dtype, op, n, root, async_op in _schedule(seed, world):
            work, check = _issue(group, rank, world, step, kind, dtype, op, n, root, async_op)
            if work is None:
                check(failures)
            else:
                pending.append((work, check))
            while len(pending) > MAX_IN_FLIGHT or (pending and pending[0][0].is_completed()):
                w, c = pending.pop(0)
                w.wait()
                c(failures)
        for w, c in pending:
            w.wait()
            c(failures)
    return failures


@pytest.mark.parametrize("world,seed", [(2, 1), (2, 2), (3, 3)])
def test_random_schedule_of_collectives(world, seed):
    for rank, failures in enumerate(run_ranks(_stress_job, world, seed, env={"FAIRSCALE_C_TIMEOUT": "60"})):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:5])
