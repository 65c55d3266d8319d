"""A randomised schedule of collectives on the shm engine: every rank draws the same sequence of
ops (kind, dtype, size, root, reduction, sync or async) from one seed, with up to four async ops
in flight at once and waits deferred behind later ops, so ops of very different sizes interleave
in the engine's slots. Every result is checked against a torch reference that each rank computes
from the other ranks' (seeded) inputs. Ops include all_to_all_single with uneven splits and
batches of a ring exchange plus a local copy, and each rank decides for itself, op by op, whether
its buffers of a float32 or bfloat16 op lie in shared tensors: when every rank's do, the op runs
on the mapped paths, and when only some do, the ranks must agree to fall back. A protocol slip (a
slot reused too early, a result written to the wrong op, a lost wake-up, ranks taking different
paths) shows up as a wrong value or a timeout, not as a hang."""

from __future__ import annotations

import random

import pytest
import torch

from dist_utils import run_ranks, orphaned_segments
from test_collectives import _check, _data, _reference

# Sizes straddle the 1 MiB pipeline chunk for every dtype (262144 float32 elements per chunk).
SIZES = [1, 7, 1000, 65_537, 262_144, 262_145, 700_001]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64]
KINDS = [
    "all_reduce",
    "all_gather",
    "all_gather_inplace",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "ring",
    "barrier",
    "all_to_all",
    "batch",
]
STEPS = 120
MAX_IN_FLIGHT = 4
SHARED_DTYPES = (torch.float32, torch.bfloat16)  # what the features keep in shared tensors
POOL_NUMEL = 8 << 20  # per dtype and rank: enough for the ops in flight, drained when full


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


class _Pool:
    """Slices of one shared tensor handed out in turn; ``take`` returns None when the rest is too
    small (the caller then waits for every op in flight and calls ``reset``)."""

    def __init__(self, tensor):
        self.tensor, self.offset = tensor, 0

    def take(self, n):
        if self.offset + n > self.tensor.numel():
            return None
        t = self.tensor[self.offset : self.offset + n]
        self.offset += n
        return t

    def reset(self):
        self.offset = 0


def _splits(seed, step, world, n):
    """rows[i][j]: the rows rank i sends rank j in step's all_to_all (zeros included), the same on
    every rank; and the row width."""
    rng = random.Random(seed * 104729 + step)
    cap = max(1, min(n, 50_000) // world)
    return [[rng.choice([0, rng.randint(1, cap)]) for _ in range(world)] for _ in range(world)], rng.choice([1, 3])


def _issue(group, rank, world, step, kind, dtype, op, n, root, async_op, alloc, seed):
    """Start one op; returns (work or None, a check(failures) callable). ``alloc(n, dtype)`` gives
    the op's buffers (in a shared tensor or not: the rank's own choice)."""
    inputs = [_data(r, n, dtype, step) for r in range(world)]
    mine = alloc(n, dtype).copy_(inputs[rank])
    if kind == "all_to_all":
        rows, width = _splits(seed, step, world, n)
        sent = [_data(r, sum(rows[r]) * width, dtype, step).view(-1, width) for r in range(world)]
        src = alloc(sent[rank].numel(), dtype).view(-1, width).copy_(sent[rank])
        out = alloc(sum(rows[r][rank] for r in range(world)) * width, dtype).view(-1, width)
        out_splits = [rows[r][rank] for r in range(world)]
        work = group.all_to_all_single(out, src, out_splits, rows[rank], async_op=async_op)
        want = torch.cat([sent[r][sum(rows[r][:rank]) : sum(rows[r][: rank + 1])] for r in range(world)])
        return work, lambda f: _check(out, want, f"{step}: all_to_all {rows}", f)
    if kind == "batch":  # ring exchange plus a local copy, items in this rank's own order
        got, kept = alloc(n, dtype), alloc(n, dtype)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        items = [("send", mine, nxt), ("recv", got, prv), ("copy", kept, mine)]
        random.Random(seed * 31 + rank * 1009 + step).shuffle(items)
        work = group.batch(items, async_op=async_op)

        def check(f):
            _check(got, inputs[prv], f"{step}: batch recv {[i[0] for i in items]}", f)
            _check(kept, inputs[rank], f"{step}: batch copy {[i[0] for i in items]}", f)

        return work, check
    if kind == "all_reduce":
        work = group.all_reduce(mine, op=op, async_op=async_op)
        return work, lambda f: _check(mine, _reference(inputs, op, dtype), f"{step}: all_reduce {op}", f, reduced=True)
    if kind in ("all_gather", "all_gather_inplace"):
        out = alloc(n * world, dtype)
        src = mine
        if kind == "all_gather_inplace":
            out[rank * n : (rank + 1) * n] = mine
            src = out[rank * n : (rank + 1) * n]
        work = group.all_gather(out, src, async_op=async_op)
        return work, lambda f: _check(out, torch.cat(inputs), f"{step}: {kind}", f)
    if kind == "reduce_scatter":
        full = [_data(r, n * world, dtype, step) for r in range(world)]
        out = alloc(n, dtype)
        work = group.reduce_scatter(out, alloc(n * world, dtype).copy_(full[rank]), op=op, async_op=async_op)
        want = _reference([x[rank * n : (rank + 1) * n] for x in full], op, dtype)
        return work, lambda f: _check(out, want, f"{step}: reduce_scatter {op}", f, reduced=True)
    if kind == "broadcast":
        work = group.broadcast(mine, root, async_op=async_op)
        return work, lambda f: _check(mine, inputs[root], f"{step}: broadcast from {root}", f)
    if kind == "reduce":
        work = group.reduce(mine, root, op=op, async_op=async_op)
        want = _reference(inputs, op, dtype) if rank == root else inputs[rank]
        return work, lambda f: _check(mine, want, f"{step}: reduce {op} to {root}", f, reduced=rank == root)
    if kind == "ring":  # to the next rank, from the previous one; rank 0 sends first, the rest receive first
        got = alloc(n, dtype)
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
    mine = random.Random(seed * 7 + rank)  # this rank's own choice of shared or private buffers

    def drain():
        while pending:
            w, c = pending.pop(0)
            w.wait()
            c(failures)

    with fdist.init_group(name=f"stress-{seed}") as group:
        pools = {dt: _Pool(fdist.shared_empty(POOL_NUMEL, dtype=dt, group=group)) for dt in SHARED_DTYPES}
        assert all(fdist.is_shared(p.tensor) for p in pools.values())
        for step, kind, dtype, op, n, root, async_op in _schedule(seed, world):
            shared = dtype in pools and mine.random() < 0.7

            def alloc(numel, dt, shared=shared):
                if not shared:
                    return torch.empty(numel, dtype=dt)
                t = pools[dt].take(numel)
                if t is None:  # every slice may still be in use by an op in flight
                    drain()
                    pools[dt].reset()
                    t = pools[dt].take(numel)
                return t

            work, check = _issue(group, rank, world, step, kind, dtype, op, n, root, async_op, alloc, seed)
            if work is None:
                check(failures)
            else:
                pending.append((work, check))
            while len(pending) > MAX_IN_FLIGHT or (pending and pending[0][0].is_completed()):
                w, c = pending.pop(0)
                w.wait()
                c(failures)
        drain()
        mapped = group._shm.mapped_ops if group._shm is not None else 0
    return failures, mapped


@pytest.mark.parametrize("world,seed", [(2, 1), (2, 2), (3, 3), (4, 4)])
def test_random_schedule_of_collectives(world, seed):
    results = run_ranks(_stress_job, world, seed, env={"FAIRSCALE_C_TIMEOUT": "60"})
    for rank, (failures, _) in enumerate(results):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:5])
    assert all(mapped > 0 for _, mapped in results), f"no op ran on the mapped paths: {results}"


P2P_STEPS = 40


def _p2p_plan(seed: int, world: int):
    """Per step, the messages every rank agrees on: (sender, receiver, numel, dtype), in order."""
    rng = random.Random(seed)
    for step in range(P2P_STEPS):
        msgs = []
        for _ in range(rng.randint(1, 3 * world)):
            src = rng.randrange(world)
            dst = rng.choice([r for r in range(world) if r != src])
            msgs.append((src, dst, rng.choice(SIZES), rng.choice(DTYPES)))
        yield step, msgs, rng.random() < 0.3


def _p2p_stress_job(rank, world, seed):
    import fairscale_c.distributed as fdist

    mine = random.Random(1000 * seed + rank)  # this rank's own choices: recv order, sync or async
    failures = []
    with fdist.init_group(name=f"p2p-stress-{seed}") as group:
        for step, msgs, collective in _p2p_plan(seed, world):
            sends = [
                group.send(_data(s, n, dt, 100 * step + i), d, async_op=True)
                for i, (s, d, n, dt) in enumerate(msgs)
                if s == rank
            ]
            # receives in a random order across senders, each sender's in plan order
            queues = {}
            for i, (s, d, n, dt) in enumerate(msgs):
                if d == rank:
                    queues.setdefault(s, []).append((i, n, dt))
            pending = []
            while queues:
                src = mine.choice(sorted(queues))
                i, n, dt = queues[src].pop(0)
                if not queues[src]:
                    del queues[src]
                out = torch.empty(n, dtype=dt)
                want = _data(src, n, dt, 100 * step + i)
                if mine.random() < 0.5:  # synchronous, behind this rank's sends that may still wait
                    group.recv(out, src)
                    _check(out, want, f"{step}: message {i} from {src}", failures)
                else:
                    pending.append((group.recv(out, src, async_op=True), out, want, i, src))
            for work, out, want, i, src in pending:
                work.wait()
                _check(out, want, f"{step}: message {i} from {src} (async)", failures)
            for work in sends:
                work.wait()
            if collective:  # a collective queued behind the point-to-point items
                t = torch.full((3,), float(rank))
                group.all_reduce(t)
                _check(t, torch.full((3,), float(sum(range(world)))), f"{step}: all_reduce", failures)
    return failures


@pytest.mark.parametrize("world,seed", [(2, 5), (3, 6)])
def test_random_point_to_point_with_sync_receives_behind_pending_sends(world, seed):
    """Random messages between every pair: each rank isends its messages of a step, then receives
    its own in a random order across senders, each synchronously or not; every message is
    checked, and no rank waits for another."""
    results = run_ranks(_p2p_stress_job, world, seed, env={"FAIRSCALE_C_TIMEOUT": "60"})
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:5])
