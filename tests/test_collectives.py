"""fairscale_c.distributed on CPU (shm engine): every op x dtype x size at 2 and 4 ranks against a
torch reference, async overlap, subgroups, failures, and a clean /dev/shm after each test."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dist_utils import not_close, not_equal, run_ranks, orphaned_segments

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8]
SIZES = [1, 1001, 300_007]  # one element, odd, several pipeline chunks
OPS = ["sum", "avg", "max", "min"]


@pytest.fixture(autouse=True)
def clean_dev_shm():
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


def _data(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 7919 + n * 31 + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float32).to(dtype)
    lo, hi = (0, 60) if dtype == torch.uint8 else (-1000, 1000)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def _reference(xs, op: str, dtype: torch.dtype) -> torch.Tensor:
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    stack = torch.stack([x.to(acc_dtype) for x in xs])
    if op in ("sum", "avg"):
        out = stack.sum(0, dtype=acc_dtype) if dtype.is_floating_point else stack.sum(0).to(dtype)
        if op == "avg":
            out = out / len(xs)
    else:
        out = stack.amax(0) if op == "max" else stack.amin(0)
    return out.to(dtype)


def _check(got, want, what, failures, reduced=False):
    """Copies must be exact; so must integer reductions. Floating-point reductions may round
    differently from torch's (order of summation, half-precision accumulation)."""
    if not reduced or not got.dtype.is_floating_point:
        msg = not_equal(got, want)
    else:
        tol = 2e-3 if got.dtype == torch.float16 else None
        msg = not_close(got, want, rtol=tol, atol=tol)
    if msg:
        failures.append(f"{what}: {msg}")


def _init(how: str):
    import fairscale_c.distributed as fdist

    if how == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    return fdist.init_group()


def _all_ops_job(rank: int, world: int, how: str):
    group = _init(how)
    failures = []
    for dtype in DTYPES:
        for n in SIZES:
            xs = [_data(r, n, dtype, 1) for r in range(world)]
            ops = OPS if dtype.is_floating_point else ["sum", "max", "min"]
            # this rank's block of every rank's reduce_scatter input (the rest is never compared)
            full = [_data(r, n * world, dtype, 2) for r in range(world)]
            mine = [x[rank * n : (rank + 1) * n] for x in full]
            for op in ops:
                want = _reference(xs, op, dtype)
                t = xs[rank].clone()
                group.all_reduce(t, op=op)
                _check(t, want, f"all_reduce {op} {dtype} n={n}", failures, reduced=True)
                out = torch.empty(n, dtype=dtype)
                group.reduce_scatter(out, full[rank], op=op)
                _check(out, _reference(mine, op, dtype), f"reduce_scatter {op} {dtype} n={n}", failures, reduced=True)
                t = xs[rank].clone()
                group.reduce(t, root=world - 1, op=op)
                if rank == world - 1:
                    _check(t, want, f"reduce {op} {dtype} n={n}", failures, reduced=True)
                else:
                    _check(t, xs[rank], f"reduce leaves a non-root input alone {op} {dtype} n={n}", failures)
            out = torch.empty(n * world, dtype=dtype)
            group.all_gather(out, xs[rank])
            _check(out, torch.cat(xs), f"all_gather {dtype} n={n}", failures)
            out = torch.zeros(n * world, dtype=dtype)
            out[rank * n : (rank + 1) * n] = xs[rank]
            group.all_gather(out, out[rank * n : (rank + 1) * n])  # in place, as FSDP calls it
            _check(out, torch.cat(xs), f"all_gather in place {dtype} n={n}", failures)
            for root in (0, world - 1):
                t = xs[rank].clone()
                group.broadcast(t, root=root)
                _check(t, xs[root], f"broadcast root={root} {dtype} n={n}", failures)
            t = torch.zeros_like(xs[rank])
            if rank % 2 == 0:
                group.send(xs[rank], rank + 1)
                group.recv(t, rank + 1)
                _check(t, xs[rank + 1], f"recv {dtype} n={n}", failures)
            else:
                group.recv(t, rank - 1)
                group.send(xs[rank], rank - 1)
                _check(t, xs[rank - 1], f"recv {dtype} n={n}", failures)
            group.barrier()
    # one 64 MiB case, in integer-valued floats: their sums are exact in any order
    n = 16 * 1024 * 1024
    xs = [_data(r, n, torch.int32, 3).float() for r in range(world)]
    t = xs[rank].clone()
    group.all_reduce(t)
    _check(t, torch.stack(xs).sum(0), "all_reduce 64 MiB", failures)
    out = torch.empty(n, dtype=torch.float32)
    group.all_gather(out, xs[rank][: n // world])
    _check(out, torch.cat([x[: n // world] for x in xs]), "all_gather 64 MiB", failures)
    per = n // world
    out = torch.zeros(n, dtype=torch.float32)
    out[rank * per : (rank + 1) * per] = xs[rank][:per]
    group.all_gather(out, out[rank * per : (rank + 1) * per])
    _check(out, torch.cat([x[:per] for x in xs]), "all_gather in place 64 MiB", failures)
    try:  # overlapping the output anywhere but this rank's block: refused before anything is sent
        group.all_gather(out, out[1 : 1 + per])
        failures.append("all_gather with a misplaced overlapping input did not raise")
    except ValueError as e:
        if "in-place form" not in str(e):
            failures.append(f"all_gather overlap error does not explain itself: {e}")
    group.destroy()
    return failures


@pytest.mark.parametrize("world,how", [(2, "torch"), (4, "env")])
def test_every_op_dtype_size(world, how):
    results = run_ranks(_all_ops_job, world, how, env={"FAIRSCALE_C_TIMEOUT": "60"})
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])


def _overlap_job(rank: int, world: int):
    group = _init("env")
    n = 4 * 1024 * 1024
    xs = [_data(r, n, torch.float32, 4) for r in range(world)]
    t = xs[rank].clone()
    if rank == 1:
        time.sleep(1.0)  # rank 0's op cannot finish before this
    w1 = group.all_reduce(t, async_op=True)
    out = torch.empty(n * world)
    w2 = group.all_gather(out, xs[rank], async_op=True)
    rs = torch.empty(n // world)
    w3 = group.reduce_scatter(rs, xs[rank], op="max", async_op=True)
    iterations, seen_pending = 0, False
    start = time.perf_counter()
    while not w1.is_completed():
        seen_pending = True
        sum(range(1000))  # Python keeps running while the collective is in flight
        iterations += 1
    busy = time.perf_counter() - start
    assert w3.wait(timeout=60) is True
    assert w1.is_completed() and w2.is_completed()
    w2.wait()
    torch.testing.assert_close(t, _reference(xs, "sum", torch.float32))
    torch.testing.assert_close(out, torch.cat(xs))
    torch.testing.assert_close(
        rs, _reference([x for x in xs], "max", torch.float32)[rank * (n // world) : (rank + 1) * (n // world)]
    )
    group.destroy()
    return seen_pending, iterations, busy


def test_async_overlap():
    (pending, iterations, busy), _ = run_ranks(_overlap_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert pending and busy > 0.5 and iterations > 100, (pending, iterations, busy)


def _subgroup_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    group = _init("env")
    pairs = [group.new_group([0, 2]), group.new_group([1, 3])]
    mine = pairs[rank % 2]
    assert pairs[1 - rank % 2] is None and mine.size == 2 and mine.rank == rank // 2
    t = torch.full((5,), float(rank))
    mine.all_reduce(t)
    assert t.tolist() == [float(rank % 2 * 2 + 2)] * 5, t
    # ranks left out of a subgroup still count it: the next subgroup's members meet
    solo = group.new_group([0])
    assert (solo is None) == (rank != 0)
    everyone = group.new_group([0, 1, 2, 3])
    t = torch.ones(2)
    everyone.all_reduce(t)
    assert t.tolist() == [4.0, 4.0], t
    everyone.destroy()
    everyone = group.new_group()  # None: every rank, as in torch
    assert everyone.size == 4 and everyone.rank == rank
    everyone.destroy()
    for bad in ([0.0, 1.9], ["0", "1"], [True, False], [0, 0], [], [4]):
        with pytest.raises(ValueError, match="distinct int ranks"):
            group.new_group(bad)
    if solo is not None:
        solo.destroy()
    trio = group.new_group([3, 1, 2])  # order defines subgroup ranks
    if rank == 0:
        assert trio is None
    else:
        assert trio.rank == [3, 1, 2].index(rank)
        t = torch.tensor([float(rank)])
        trio.broadcast(t, root=0)
        assert t.item() == 3.0
        inner = trio.new_group([1, 2])  # ranks of trio: global 1 and 2
        if inner is not None:
            t = torch.tensor([rank])
            inner.all_reduce(t, op="max")
            assert t.item() == 2
            inner.destroy()
        trio.destroy()
    fdist.all_reduce(torch.ones(3))  # default group still usable
    for g in pairs:
        if g is not None:
            g.destroy()
    with group:
        group.barrier()
    return True


def test_subgroups():
    assert all(run_ranks(_subgroup_job, 4, env={"FAIRSCALE_C_TIMEOUT": "60"}))


def _cycles_job(rank: int, world: int):
    """Build, use and destroy a group many times; return what the process holds before and after."""
    import gc

    import fairscale_c.distributed as fdist
    import torch.distributed as dist

    def held():
        gc.collect()
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        with open("/proc/self/maps") as f:
            maps = sum(1 for line in f if "/dev/shm/fsc-" in line)
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), maps, rss_pages

    dist.init_process_group("gloo")
    t = torch.ones(1 << 16)
    with fdist.init_group() as g:  # warm-up: first-use allocations of torch and the engine
        g.all_reduce(t)
    before = held()
    for _ in range(30):
        with fdist.init_group() as g:
            g.all_reduce(t, async_op=True).wait()
            out = torch.empty(world * t.numel())
            g.all_gather(out, t)
    after = held()
    dist.destroy_process_group()
    return before, after


def test_groups_release_everything_they_hold():
    """30 build/use/destroy cycles: no file descriptor, thread or shared-memory mapping is left,
    and resident memory stays flat (each cycle maps a segment of tens of MiB)."""
    for before, after in run_ranks(_cycles_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}):
        fds, threads, maps, rss = before
        assert after[0] <= fds, f"file descriptors {fds} -> {after[0]}"
        assert after[1] <= threads, f"threads {threads} -> {after[1]}"
        assert after[2] == maps == 0, f"/dev/shm mappings {maps} -> {after[2]}"
        if "asan" not in os.environ.get("LD_PRELOAD", ""):  # ASan's quarantine keeps freed memory resident
            assert (after[3] - rss) * os.sysconf("SC_PAGE_SIZE") < 16 * 2**20, f"RSS pages {rss} -> {after[3]}"


def _nan_job(rank: int, world: int):
    """max and min propagate a NaN whichever rank holds it, as torch.amax/amin over the stacked
    inputs do: on the slots (small and chunked), on the direct reads, and on shared tensors, whose
    large float reductions run the streaming kernels."""
    import fairscale_c.distributed as fdist

    group = _init("env")
    failures = []
    cases = [(torch.float32, 7, False), (torch.float16, 1001, False), (torch.bfloat16, 300_007, False)]
    cases += [
        (torch.float64, 300_007, False),
        (torch.float32, (17 << 20) // 4, True),
        (torch.float64, (17 << 20) // 8, True),
    ]
    for dtype, n, shared in cases:
        n = n // world * world
        xs = []
        for r in range(world):
            x = _data(r, n, torch.float32, 5).to(dtype)
            x[r :: world + 1] = float("nan")  # each rank's NaNs at its own places, some shared with others'
            x[-1 - r] = float("inf") if r % 2 else float("-inf")
            xs.append(x)
        stack = torch.stack(xs)
        for op, want in (("max", stack.amax(0)), ("min", stack.amin(0))):
            t = fdist.shared_empty(n, dtype=dtype, group=group) if shared else torch.empty(n, dtype=dtype)
            t.copy_(xs[rank])
            group.all_reduce(t, op=op)
            if not torch.equal(t.isnan(), want.isnan()) or not torch.equal(t.nan_to_num(0), want.nan_to_num(0)):
                failures.append(
                    f"all_reduce {op} {dtype} n={n} shared={shared}: {int((t.isnan() != want.isnan()).sum())} differ"
                )
            blk = n // world
            out = torch.empty(blk, dtype=dtype)
            group.reduce_scatter(out, xs[rank].clone(), op=op)
            mine = want[rank * blk : (rank + 1) * blk]
            if not torch.equal(out.isnan(), mine.isnan()):
                failures.append(f"reduce_scatter {op} {dtype} n={n}: NaNs differ")
            t = xs[rank].clone()
            group.reduce(t, root=world - 1, op=op)
            if rank == world - 1 and not torch.equal(t.isnan(), want.isnan()):
                failures.append(f"reduce {op} {dtype} n={n}: NaNs differ")
    group.destroy()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_max_and_min_propagate_nan_from_any_rank(world):
    results = run_ranks(_nan_job, world, env={"FAIRSCALE_C_TIMEOUT": "120"}, timeout=300)
    assert results == [[]] * world, results


def _byte_moving_dtypes_job(rank: int, world: int):
    """int8, int16 and bool tensors move through every op that only copies (gloo's and NCCL's
    collectives take them too); reductions refuse them with a message naming the dtype."""
    import fairscale_c.distributed as fdist

    group = _init("env")
    failures = []
    for dtype in (torch.int8, torch.int16, torch.bool):
        xs = [
            (torch.arange(1001) * (r + 3) % 7 > 2)
            if dtype == torch.bool
            else (torch.arange(1001) * (r + 3) % 100 - 50).to(dtype)
            for r in range(world)
        ]
        out = torch.empty(1001 * world, dtype=dtype)
        group.all_gather(out, xs[rank])
        if not torch.equal(out, torch.cat(xs)):
            failures.append(f"all_gather {dtype}")
        b = xs[rank].clone()
        group.broadcast(b, root=world - 1)
        if not torch.equal(b, xs[world - 1]):
            failures.append(f"broadcast {dtype}")
        got = torch.empty(1001, dtype=dtype)
        right, left = (rank + 1) % world, (rank - 1) % world
        group.batch([fdist.P2POp("recv", got, left), fdist.P2POp("send", xs[rank], right)])
        if not torch.equal(got, xs[left]):
            failures.append(f"send/recv {dtype}")
        a2a = torch.empty(world * 3, dtype=dtype)
        group.all_to_all_single(a2a, torch.cat([xs[rank][:3]] * world))
        if not torch.equal(a2a, torch.cat([x[:3] for x in xs])):
            failures.append(f"all_to_all_single {dtype}")
        try:
            group.all_reduce(xs[rank].clone())
            failures.append(f"all_reduce {dtype} accepted")
        except ValueError as e:
            if f"dtype {str(dtype).replace('torch.', '')}; a reduction takes one of" not in str(e):
                failures.append(f"all_reduce {dtype}: {e}")
    group.destroy()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_int8_int16_and_bool_move_through_copying_ops(world):
    assert run_ranks(_byte_moving_dtypes_job, world, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [[]] * world
