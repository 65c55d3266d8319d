"""Direct reads in the shared-memory engine: all_gather, broadcast, reduce_scatter and all_reduce
in a size window read the peers' data straight out of their buffers (process_vm_readv), when every
rank of the group can read its peers' memory. Checked here: the ranks agree on the window (or on
none, where the kernel refuses), results equal a torch reference on both sides of the window's
edges, in place and out of place, sync and async, interleaved with ops that go through the slots,
every rank gets the same all_reduce bits, and a peer that dies during a direct op is reported, not
waited for."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch

from dist_utils import Checks, clean_dev_shm, rank_data, run_ranks  # noqa: F401 (a fixture)

KiB, MiB = 1024, 1024 * 1024
NO_LIMIT = 2**64 - 1  # FAIRSCALE_C_SHM_DIRECT_MAX's default (SIZE_MAX)
DIRECT_MIN = 32 * KiB  # csrc/comm/shm_coll.c, FSC_SHM_DIRECT_MIN


pytestmark = pytest.mark.usefixtures("clean_dev_shm")


_READER = r"""
import ctypes, sys
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
pid, addr, want = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
v = ctypes.c_uint64(0)
local, remote = iovec(ctypes.addressof(v), 8), iovec(addr, 8)
got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
sys.exit(0 if got == 8 and v.value == want else 1)
"""


def _peers_can_read() -> bool:
    """Whether a process may read another of this user's processes that is not its descendant (a
    child reading its parent: what ptrace policies such as Yama's treat like two sibling ranks)."""
    word = ctypes.c_uint64(0x5EED_F00D_1234_5678)
    r = subprocess.run(
        [sys.executable, "-c", _READER, str(os.getpid()), str(ctypes.addressof(word)), str(word.value)],
        timeout=60,
    )
    return r.returncode == 0


def _limit_job(rank: int, world: int, limits, modes=None):
    if limits[rank] is not None:
        os.environ["FAIRSCALE_C_SHM_DIRECT_MAX"] = str(limits[rank])
    if modes is not None and modes[rank] is not None:
        os.environ["FAIRSCALE_C_SHM_DIRECT_READS"] = modes[rank]
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="limits")
    got = group._shm.direct_max if modes is None else group._shm.read_max
    group.destroy()
    return got


@pytest.mark.parametrize(
    "world,limits,agreed",
    [
        (2, [None, None], NO_LIMIT),  # the default
        (3, [4 * MiB, 1 * MiB, 8 * MiB], 1 * MiB),  # the smallest rank's limit
        (2, [0, None], 0),  # one rank turning it off turns it off for all
    ],
)
def test_ranks_agree_on_the_window(world, limits, agreed):
    can = _peers_can_read()
    got = run_ranks(_limit_job, world, limits, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert len(set(got)) == 1, f"ranks disagree on direct_max: {got}"
    assert got[0] == (agreed if can else 0), (got, "peers readable" if can else "peers not readable")


@pytest.mark.parametrize(
    "modes,reads",
    [
        ([None, None], True),  # auto (the default): the window stays; rank 0 times the ways per op
        (["on", "auto"], True),
        (["off", "on"], False),  # "off" on any rank keeps private buffers on the slots
    ],
)
def test_ranks_agree_on_reading_private_buffers(modes, reads):
    can = _peers_can_read()
    got = run_ranks(_limit_job, 2, [None, None], modes, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert len(set(got)) == 1, f"ranks disagree on read_max: {got}"
    assert got[0] == (NO_LIMIT if reads and can else 0), got


LIMIT = 4 * MiB  # FAIRSCALE_C_SHM_DIRECT_MAX in the jobs below
ALL_REDUCE_MIN = 2 * MiB  # csrc/comm/shm_direct.c, FSC_SHM_DIRECT_ALL_REDUCE_MIN


def _ops_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="direct")
    limit = group._shm.direct_max
    check, digests = Checks(world), []
    failures, summed = check.failures, check.summed

    # blocks just below the minimum (slots), at it (direct), odd byte counts, and ops just above
    # the limit (slots again) and at it
    for dtype, nbytes in [
        (torch.float32, DIRECT_MIN - 4),
        (torch.float32, DIRECT_MIN),
        (torch.uint8, DIRECT_MIN + 1),
        (torch.float64, 96 * KiB),
        (torch.bfloat16, 200 * KiB + 2),
        (torch.uint8, LIMIT // world + 3),
        (torch.float32, LIMIT // world),
    ]:
        n = nbytes // torch.empty(0, dtype=dtype).element_size()
        xs = [rank_data(r, n, dtype, 1) for r in range(world)]
        want = torch.cat(xs)
        out = torch.empty(n * world, dtype=dtype)
        group.all_gather(out, xs[rank])
        check(out, want, f"all_gather {dtype} block {nbytes} B")
        inplace = torch.zeros(n * world, dtype=dtype)
        inplace[rank * n : (rank + 1) * n] = xs[rank]
        group.all_gather(inplace, inplace[rank * n : (rank + 1) * n])
        check(inplace, want, f"all_gather in place {dtype} block {nbytes} B")
        for root in range(world):
            t = xs[rank].clone()
            group.broadcast(t, root=root)
            check(t, xs[root], f"broadcast root {root} {dtype} {nbytes} B")
        full = [rank_data(r, n * world, dtype, 2) for r in range(world)]
        ops = ["sum", "max"] + (["avg"] if dtype.is_floating_point else [])
        for op in ops:
            blocks = [f[rank * n : (rank + 1) * n] for f in full]
            want = torch.stack(blocks).amax(0) if op == "max" else summed(blocks, dtype, op)
            out = torch.empty(n, dtype=dtype)
            group.reduce_scatter(out, full[rank], op=op)
            check(out, want, f"reduce_scatter {op} {dtype} block {nbytes} B", reduced=True)
            inp = full[rank].clone()  # in place: the output is this rank's block of the input
            group.reduce_scatter(inp[rank * n : (rank + 1) * n], inp, op=op)
            check(
                inp[rank * n : (rank + 1) * n], want, f"reduce_scatter in place {op} {dtype} {nbytes} B", reduced=True
            )
    for dtype, nbytes in [
        (torch.float32, ALL_REDUCE_MIN - 4),
        (torch.float32, ALL_REDUCE_MIN),
        (torch.bfloat16, ALL_REDUCE_MIN + 2 * 997),
        (torch.float64, LIMIT),
        (torch.int32, LIMIT + 4),
    ]:
        n = nbytes // torch.empty(0, dtype=dtype).element_size()
        xs = [rank_data(r, n, dtype, 3) for r in range(world)]
        for op in ["sum", "avg", "min"] if dtype.is_floating_point else ["sum", "min"]:
            t = xs[rank].clone()
            group.all_reduce(t, op=op)
            want = torch.stack(xs).amin(0) if op == "min" else summed(xs, dtype, op)
            check(t, want, f"all_reduce {op} {dtype} {nbytes} B", reduced=True)
            digests.append(hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest())
    # async: direct ops queued behind and between slot ops, each with its own buffers
    n = 72 * KiB  # divisible by 2 and 3
    works, checks = [], []
    for i in range(6):
        xs = [rank_data(r, n, torch.float32, 10 + i) for r in range(world)]
        out = torch.empty(n * world)
        works.append(group.all_gather(out, xs[rank], async_op=True))
        checks.append((out, torch.cat(xs), f"async all_gather {i}"))
        t = xs[rank].clone()
        works.append(group.all_reduce(t, async_op=True))
        checks.append((t, summed(xs, torch.float32), f"async all_reduce {i}"))
        b = xs[rank].clone()
        works.append(group.broadcast(b, root=i % world, async_op=True))
        checks.append((b, xs[i % world], f"async broadcast {i}"))
        rs = torch.empty(n // world)
        works.append(group.reduce_scatter(rs, xs[rank], async_op=True))
        checks.append(
            (
                rs,
                summed([x[rank * (n // world) : (rank + 1) * (n // world)] for x in xs], torch.float32),
                f"async reduce_scatter {i}",
            )
        )
    for w in works:
        w.wait()
    for got, want, what in checks:
        check(got, want, what, reduced=True)
    group.destroy()
    return limit, failures, digests


@pytest.mark.parametrize("world,reads", [(2, "on"), (3, "on"), (2, "auto")])
def test_results_on_both_sides_of_the_window(world, reads):
    """ "on": every op in the window reads the peers' buffers; "auto": rank 0 picks reads or slots
    for every rank, trying each way three times per op and size first."""
    env = {"FAIRSCALE_C_TIMEOUT": "60", "FAIRSCALE_C_SHM_DIRECT_MAX": str(LIMIT), "FAIRSCALE_C_SHM_DIRECT_READS": reads}
    results = run_ranks(_ops_job, world, env=env)
    limits = {limit for limit, _, _ in results}
    assert limits == {LIMIT if _peers_can_read() else 0}, limits
    failures = [f"rank {r}: {f}" for r, (_, fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])
    digests = [d for _, _, d in results]
    assert all(d == digests[0] for d in digests), "all_reduce gave the ranks different bits"


def test_results_with_direct_reads_off():
    results = run_ranks(_ops_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60", "FAIRSCALE_C_SHM_DIRECT_MAX": "0"})
    assert {limit for limit, _, _ in results} == {0}
    failures = [f"rank {r}: {f}" for r, (_, fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])


def _dies_in_direct_op_job(rank: int, world: int):
    import fairscale_c
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="dies")
    n = 256 * KiB
    out = torch.empty(n * world)
    group.all_gather(out, torch.ones(n))  # one direct op that completes
    if rank == 1:
        os._exit(1)
    start = time.perf_counter()
    try:
        group.all_gather(out, torch.ones(n))
    except fairscale_c.DistributedError as exc:
        msg = str(exc)
    else:
        msg = "no error"
    elapsed = time.perf_counter() - start
    group.destroy()
    return elapsed, msg


@pytest.mark.serial  # kills a rank; times how soon the peer knows
def test_peer_dying_during_a_direct_op_is_reported():
    (elapsed, msg), _ = run_ranks(_dies_in_direct_op_job, 2, env={"FAIRSCALE_C_TIMEOUT": "30"}, may_die=[1])
    assert "all_gather" in msg and "rank 1" in msg, msg
    assert elapsed < 10, f"dead peer found after {elapsed:.1f} s; expected well before the 30 s timeout"


def _small_sync_ops_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="small-timed")
    counts = {}
    for op, block in (("all_gather", 32 * KiB), ("broadcast", 64 * KiB), ("reduce_scatter", 128 * KiB)):
        before = group._shm.read_ops
        for _ in range(6):
            x = torch.full((block // 4,), float(rank + 1))
            if op == "all_gather":
                group.all_gather(torch.empty(world * x.numel()), x)
            elif op == "broadcast":
                group.broadcast(x, root=0)
            else:
                group.reduce_scatter(torch.empty(x.numel() // world), x)
        counts[op] = group._shm.read_ops - before
    group.destroy()
    return counts


def test_small_synchronous_ops_in_the_window_are_timed_both_ways():
    # from the window's smallest ops up ("auto"), the first six calls of an op and size alternate
    # the two ways, so three of them read; the slots won there on some machines (docs/collectives.md)
    if not _peers_can_read():
        pytest.skip("this machine's ptrace policy keeps the ranks from reading each other")
    results = run_ranks(_small_sync_ops_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert results == [{"all_gather": 3, "broadcast": 3, "reduce_scatter": 3}] * 2, results


def _switching_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="switching")
    check, digests = Checks(world), []
    for i in range(40):  # the first six of each op and size alternate the ways, then every 32nd
        n = (256 * KiB) if i % 2 else (512 * KiB)  # floats: 1 and 2 MiB per rank
        xs = [rank_data(r, n, torch.float32, 20 + i) for r in range(world)]
        out = torch.empty(n * world)
        group.all_gather(out, xs[rank])
        check(out, torch.cat(xs), f"all_gather {i}")
        t = xs[rank].clone()
        group.all_reduce(t)
        check(t, check.summed(xs, torch.float32), f"all_reduce {i}", reduced=True)
        digests.append(hashlib.sha256(t.numpy().tobytes()).hexdigest())
        rs = torch.empty(n // world)
        group.reduce_scatter(rs, xs[rank])
        blocks = [x[rank * (n // world) : (rank + 1) * (n // world)] for x in xs]
        check(rs, check.summed(blocks, torch.float32), f"reduce_scatter {i}", reduced=True)
        b = xs[rank].clone()
        group.broadcast(b, root=i % world)
        check(b, xs[i % world], f"broadcast {i}")
    group.destroy()
    return check.failures, digests


def test_ops_that_switch_ways_keep_their_results():
    """Repeated ops of sizes rank 0 times both ways ("auto"): every result right, every rank the
    same all_reduce bits, whichever way each call went."""
    results = run_ranks(_switching_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])
    assert results[0][1] == results[1][1], "all_reduce gave the ranks different bits"


def _large_ops_job(rank: int, world: int, reads: str):
    os.environ["FAIRSCALE_C_SHM_DIRECT_READS"] = reads
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="large")
    check, counts = Checks(world), {}

    def run(what, calls, op, n, async_op):
        before = group._shm.read_ops
        for i in range(calls):
            xs = [rank_data(r, n, torch.float32, 30 + i) for r in range(world)]
            if op == "all_gather":
                out = torch.empty(n * world)
                work = group.all_gather(out, xs[rank], async_op=async_op)
                want = torch.cat(xs)
            else:
                full = [rank_data(r, n * world, torch.float32, 40 + i) for r in range(world)]
                out = torch.empty(n)
                work = group.reduce_scatter(out, full[rank], async_op=async_op)
                want = check.summed([f[rank * n : (rank + 1) * n] for f in full], torch.float32)
            if async_op:
                work.wait()
            check(out, want, f"{what} call {i}", reduced=op != "all_gather")
        counts[what] = group._shm.read_ops - before

    per_rank = 12 * MiB // 4  # ops of 24 MiB and more: above the 16 MiB up to which queued ops read untimed
    run("sync all_gather, 12 MiB blocks", 6, "all_gather", per_rank, False)
    run("async all_gather, 12 MiB blocks", 2, "all_gather", per_rank, True)
    run("async all_gather, 4 MiB blocks", 2, "all_gather", per_rank // 3, True)
    run("sync reduce_scatter, 12 MiB blocks", 6, "reduce_scatter", per_rank, False)
    run("async reduce_scatter, 12 MiB blocks", 2, "reduce_scatter", per_rank, True)
    group.destroy()
    return check.failures, counts


@pytest.mark.parametrize("world,reads", [(2, "auto"), (2, "on"), (3, "auto")])
def test_ops_above_16_mib_read_when_timed_or_forced(world, reads):
    """With the default window (no limit): "auto" times synchronous ops of any size both ways,
    three calls each, alternating, and keeps queued ops above 16 MiB (reduce_scatter's input above
    8 MiB) on the slots, reading below; "on" reads every op. Every result equals torch's."""
    results = run_ranks(_large_ops_job, world, reads, env={"FAIRSCALE_C_TIMEOUT": "60"})
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])
    assert all(counts == results[0][1] for _, counts in results), f"the ranks went different ways: {results}"
    if not _peers_can_read():
        assert set(results[0][1].values()) == {0}, results[0][1]
        return
    if reads == "auto":
        want = {
            "sync all_gather, 12 MiB blocks": 3,
            "async all_gather, 12 MiB blocks": 0,
            "async all_gather, 4 MiB blocks": 2,
            "sync reduce_scatter, 12 MiB blocks": 3,
            "async reduce_scatter, 12 MiB blocks": 0,
        }
    else:
        want = {
            "sync all_gather, 12 MiB blocks": 6,
            "async all_gather, 12 MiB blocks": 2,
            "async all_gather, 4 MiB blocks": 2,
            "sync reduce_scatter, 12 MiB blocks": 6,
            "async reduce_scatter, 12 MiB blocks": 2,
        }
    assert results[0][1] == want
