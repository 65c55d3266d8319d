"""Direct reads in the shared-memory engine: all_gather and broadcast in a size window copy each
byte once, straight out of the owner's buffer (process_vm_readv), when every rank of the group can
read its peers' memory. Checked here: the ranks agree on the window (or on none, where the kernel
refuses), results equal a torch reference on both sides of the window's edges, in place and out
of place, sync and async, interleaved with ops that go through the slots, and a peer that dies
during a direct op is reported, not waited for."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import pytest
import torch

from dist_utils import orphaned_segments, run_ranks

KiB, MiB = 1024, 1024 * 1024
DIRECT_MIN = 32 * KiB  # csrc/comm/shm_coll.c, FSC_SHM_DIRECT_MIN


@pytest.fixture(autouse=True)
def clean_dev_shm():
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


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


def _data(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 7919 + n * 31 + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 250, (n,), generator=g).to(dtype)


def _limit_job(rank: int, world: int, limits):
    if limits[rank] is not None:
        os.environ["FAIRSCALE_C_SHM_DIRECT_MAX"] = str(limits[rank])
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="limits")
    got = group._shm.direct_max
    group.destroy()
    return got


@pytest.mark.parametrize(
    "world,limits,agreed",
    [
        (2, [None, None], 16 * MiB),  # the default
        (3, [4 * MiB, 1 * MiB, 8 * MiB], 1 * MiB),  # the smallest rank's limit
        (2, [0, None], 0),  # one rank turning it off turns it off for all
    ],
)
def test_ranks_agree_on_the_window(world, limits, agreed):
    can = _peers_can_read()
    got = run_ranks(_limit_job, world, limits, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert len(set(got)) == 1, f"ranks disagree on direct_max: {got}"
    assert got[0] == (agreed if can else 0), (got, "peers readable" if can else "peers not readable")


def _ops_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="direct")
    limit = group._shm.direct_max
    failures = []

    def check(got, want, what):
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            failures.append(f"{what}: {bad.numel()} elements differ, first at {bad[0].tolist()}")

    # blocks just below the minimum (slots), at it (direct), odd byte counts, and outputs above the
    # limit (slots again); the limit is 1 MiB in this job
    for dtype, nbytes in [
        (torch.float32, DIRECT_MIN - 4),
        (torch.float32, DIRECT_MIN),
        (torch.uint8, DIRECT_MIN + 1),
        (torch.float64, 96 * KiB),
        (torch.uint8, (1 * MiB) // world + 3),  # output just above the limit
        (torch.float32, (1 * MiB) // world),  # output at the limit (or a little under)
    ]:
        n = nbytes // torch.empty(0, dtype=dtype).element_size()
        xs = [_data(r, n, dtype, 1) for r in range(world)]
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
    # async: direct ops queued behind and between slot ops, each with its own buffers
    n = 64 * KiB
    works, checks = [], []
    for i in range(6):
        xs = [_data(r, n, torch.float32, 10 + i) for r in range(world)]
        out = torch.empty(n * world)
        works.append(group.all_gather(out, xs[rank], async_op=True))
        checks.append((out, torch.cat(xs), f"async all_gather {i}"))
        t = xs[rank].clone()
        works.append(group.all_reduce(t, async_op=True))
        checks.append((t, torch.stack(xs).sum(0), f"async all_reduce {i}"))
        b = xs[rank].clone()
        works.append(group.broadcast(b, root=i % world, async_op=True))
        checks.append((b, xs[i % world], f"async broadcast {i}"))
    for w in works:
        w.wait()
    for got, want, what in checks:
        if what.startswith("async all_reduce"):
            torch.testing.assert_close(got, want)
        else:
            check(got, want, what)
    group.destroy()
    return limit, failures


@pytest.mark.parametrize("world", [2, 3])
def test_results_on_both_sides_of_the_window(world):
    results = run_ranks(_ops_job, world, env={"FAIRSCALE_C_TIMEOUT": "60", "FAIRSCALE_C_SHM_DIRECT_MAX": str(MiB)})
    limits = {limit for limit, _ in results}
    assert limits == {MiB if _peers_can_read() else 0}, limits
    failures = [f"rank {r}: {f}" for r, (_, fs) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])


def test_results_with_direct_reads_off():
    results = run_ranks(_ops_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60", "FAIRSCALE_C_SHM_DIRECT_MAX": "0"})
    assert {limit for limit, _ in results} == {0}
    failures = [f"rank {r}: {f}" for r, (_, fs) in enumerate(results) for f in fs]
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


def test_peer_dying_during_a_direct_op_is_reported():
    (elapsed, msg), _ = run_ranks(_dies_in_direct_op_job, 2, env={"FAIRSCALE_C_TIMEOUT": "30"}, may_die=[1])
    assert "all_gather" in msg and "rank 1" in msg, msg
    assert elapsed < 10, f"dead peer found after {elapsed:.1f} s; expected well before the 30 s timeout"
