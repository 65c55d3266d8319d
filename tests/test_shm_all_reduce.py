"""The shm engine's pipelined all_reduce and reduce with a 4 KiB chunk, so that every size runs
through many pipeline steps: sizes that are not a multiple of the chunk (an uneven last chunk,
a last chunk shorter than one rank's part), every dtype and reduction, 2, 3 and 4 ranks, reduce
to the first, the last and another root, in place and out of place, against a torch reference,
and every rank's result bit-identical to rank 0's."""

from __future__ import annotations

import hashlib

import pytest
import torch

from dist_utils import run_ranks, orphaned_segments
from test_collectives import DTYPES, _check, _data, _reference

CHUNK = 4096  # the smallest chunk the engine accepts
# Elements; with 4-byte elements a chunk is 1024: one chunk and one element more, a last chunk of
# 3 elements (less than a rank's 64-byte-aligned part), a long odd run, and a size whose 8-byte and
# 2-byte dtypes end on other boundaries.
SIZES = [1025, 2051, 40_003, 16_384 + 7]
REDOPS = ["sum", "avg", "max", "min"]


@pytest.fixture(autouse=True)
def clean_dev_shm():
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    failures, digests = [], {}
    with fdist.init_group(name="pipelined-all-reduce") as group:
        for dtype in DTYPES:
            for n in SIZES:
                xs = [_data(r, n, dtype, 5) for r in range(world)]
                for op in REDOPS if dtype.is_floating_point else ["sum", "max", "min"]:
                    want = _reference(xs, op, dtype)
                    t = xs[rank].clone()
                    group.all_reduce(t, op=op)
                    _check(t, want, f"all_reduce {op} {dtype} n={n}", failures, reduced=True)
                    digests[("all_reduce", str(dtype), n, op)] = _digest(t)
                    for root in sorted({0, n % world, world - 1}):
                        t = xs[rank].clone()
                        group.reduce(t, root=root, op=op, async_op=True).wait()
                        what = f"reduce {op} {dtype} n={n} root={root}"
                        _check(t, want if rank == root else xs[rank], what, failures, reduced=rank == root)
                        if rank == root:
                            digests[("reduce", str(dtype), n, op, root)] = _digest(t)
        # back to back with other ops, async, so their steps follow the all_reduce's last ones
        n = 40_003
        xs = [_data(r, n, torch.float32, 6) for r in range(world)]
        a, b = xs[rank].clone(), xs[rank].clone()
        out = torch.empty(n * world)
        works = [group.all_reduce(a, async_op=True), group.all_gather(out, xs[rank], async_op=True)]
        works.append(group.all_reduce(b, op="max", async_op=True))
        for w in works:
            w.wait()
        _check(a, _reference(xs, "sum", torch.float32), "async all_reduce sum", failures, reduced=True)
        _check(out, torch.cat(xs), "async all_gather after all_reduce", failures)
        _check(b, _reference(xs, "max", torch.float32), "async all_reduce max after all_gather", failures, reduced=True)
    return failures, digests


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipelined_all_reduce_small_chunk(world):
    env = {"FAIRSCALE_C_SHM_CHUNK": str(CHUNK), "FAIRSCALE_C_TIMEOUT": "60"}
    results = run_ranks(_job, world, env=env)
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])
    ref = results[0][1]
    for r, (_, digests) in enumerate(results[1:], start=1):
        for key, d in digests.items():
            if key[0] == "all_reduce":
                assert d == ref[key], f"rank {r}: {key} differs from rank 0's bits"
