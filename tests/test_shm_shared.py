"""Shared tensors (fairscale_c.distributed.shared_empty): CPU tensors every rank of a group maps.
Collectives whose buffers on every rank lie in one such allocation copy straight between the ranks'
mappings. Checked here: results equal a torch reference for every op, in place and out of place,
below, inside and above the window of direct reads, with direct reads off, and for 3 ranks; the
mapped path really ran (the group's mapped_ops count); a rank passing an ordinary tensor sends
the op through the other paths, with the same results; every rank gets the same all_reduce bits;
freed tensors leave no mapping, descriptor or /dev/shm entry behind; bad arguments raise on every
rank with a message naming them."""

from __future__ import annotations

import hashlib
import os
import time
import warnings

import pytest
import torch

from dist_utils import Checks, clean_dev_shm, rank_data, run_ranks  # noqa: F401 (a fixture)

KiB, MiB = 1024, 1024 * 1024


pytestmark = pytest.mark.usefixtures("clean_dev_shm")


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("fairscale_c-shared" in line for line in f)


def _ops_job(rank: int, world: int):
    import fairscale_c.distributed as fdist
    from fairscale_c import _C

    group = fdist.init_group(name="shared")
    fds_before = len(os.listdir("/proc/self/fd"))
    shm = group._shm
    check, digests = Checks(world), []
    failures, summed = check.failures, check.summed

    def mapped(what, before, expect=True):
        ran = shm.mapped_ops > before
        if ran != expect:
            failures.append(f"{what}: {'ran' if ran else 'did not run'} on the mappings")

    # 60 KiB: in the direct reads' window (or the slots when they are off); from 1 MiB, also
    # above the default 16 MiB limit: asked, then mapped
    for dtype, nbytes in [
        (torch.float32, 60 * KiB),
        (torch.bfloat16, 3 * MiB // 2 + 2 * 6),
        (torch.float32, 20 * MiB),
        (torch.int32, 3 * MiB),
        (torch.float64, 18 * MiB),  # from 16 MiB floats are reduced with streaming stores
    ]:
        n = nbytes // torch.empty(0, dtype=dtype).element_size() // world * world
        big = n * (dtype.itemsize if hasattr(dtype, "itemsize") else 4) >= MiB
        blk = n // world
        xs = [rank_data(r, n, dtype, 1) for r in range(world)]
        refs = {}

        def ref(op, xs=xs, dtype=dtype, refs=refs):  # the reduction of xs by op, computed once
            if op not in refs:
                stacked = {"min": torch.amin, "max": torch.amax}.get(op)
                refs[op] = stacked(torch.stack(xs), 0) if stacked else summed(xs, dtype, op)
            return refs[op]

        # all_reduce in place, every op
        t = fdist.shared_empty(n, dtype=dtype, group=group)
        assert fdist.is_shared(t) and t.dtype == dtype and t.shape == (n,) and bool((t == 0).all())
        for op in ["sum", "avg", "min"] if dtype.is_floating_point else ["sum", "max"]:
            t.copy_(xs[rank])
            before = shm.mapped_ops
            group.all_reduce(t, op=op)
            check(t, ref(op), f"all_reduce {op} {dtype} {nbytes} B", reduced=True)
            mapped(f"all_reduce {op} {dtype} {nbytes} B", before, expect=big)
            digests.append(hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest())
        # all_gather in place and out of place (input shared)
        before = shm.mapped_ops
        t[rank * blk : (rank + 1) * blk] = xs[rank][:blk]
        group.all_gather(t, t[rank * blk : (rank + 1) * blk])
        check(t, torch.cat([x[:blk] for x in xs]), f"all_gather in place {dtype} {nbytes} B")
        inp = fdist.shared_empty(blk, dtype=dtype, group=group)
        inp.copy_(xs[rank][blk:] if world == 2 else xs[rank][:blk])
        out = torch.empty(n, dtype=dtype)
        group.all_gather(out, inp)
        check(out, torch.cat([x[blk:] if world == 2 else x[:blk] for x in xs]), f"all_gather {dtype} {nbytes} B")
        mapped(f"all_gather {dtype} {nbytes} B", before, expect=big)
        before = shm.mapped_ops  # the outputs shared, the input not: every rank writes into every output
        mine = xs[rank][:blk].clone()
        group.all_gather(t, mine)
        check(t, torch.cat([x[:blk] for x in xs]), f"all_gather into shared outputs {dtype} {nbytes} B")
        mapped(f"all_gather into shared outputs {dtype} {nbytes} B", before, expect=big)
        # reduce_scatter out of place and in place
        before = shm.mapped_ops
        t.copy_(xs[rank])
        out = torch.empty(blk, dtype=dtype)
        group.reduce_scatter(out, t)
        want = summed([x[rank * blk : (rank + 1) * blk] for x in xs], dtype)
        check(out, want, f"reduce_scatter {dtype} {nbytes} B", reduced=True)
        group.reduce_scatter(t[rank * blk : (rank + 1) * blk], t)
        check(t[rank * blk : (rank + 1) * blk], want, f"reduce_scatter in place {dtype} {nbytes} B", reduced=True)
        mapped(f"reduce_scatter {dtype} {nbytes} B", before, expect=big)
        # broadcast from every root
        for root in range(world):
            before = shm.mapped_ops
            t.copy_(xs[rank])
            group.broadcast(t, root=root)
            check(t, xs[root], f"broadcast root {root} {dtype} {nbytes} B")
            # a 60 KiB broadcast is in the direct reads' window: mapped there too, when they are on
            mapped(f"broadcast {dtype} {nbytes} B", before, expect=big or shm.direct_max > 0)
        # reduce to every root: every rank reduces its part into the root's tensor; the others'
        # tensors are left as they were, as on the slots
        for root in range(world):
            for op in ["sum", "avg"] if dtype.is_floating_point else ["sum", "max"]:
                before = shm.mapped_ops
                t.copy_(xs[rank])
                group.reduce(t, root=root, op=op)
                what = f"reduce {op} to {root} {dtype} {nbytes} B"
                check(t, ref(op) if rank == root else xs[rank], what, reduced=rank == root)
                mapped(what, before, expect=big)
            # the root's tensor ordinary: the slots
            before = shm.mapped_ops
            mine = xs[rank].clone() if rank == root else t.copy_(xs[rank])
            group.reduce(mine, root=root)
            what = f"reduce to {root} with an ordinary root tensor {dtype} {nbytes} B"
            check(mine, ref("sum") if rank == root else xs[rank], what, reduced=rank == root)
            mapped(what, before, expect=False)
        # one rank passes an ordinary tensor: nobody maps, the results are the same
        before = shm.mapped_ops
        mine = xs[rank].clone() if rank == world - 1 else t.copy_(xs[rank])
        group.all_reduce(mine)
        check(mine, ref("sum"), f"all_reduce with one ordinary tensor {dtype} {nbytes} B", reduced=True)
        mapped(f"all_reduce with one ordinary tensor {dtype} {nbytes} B", before, expect=False)
        del t, inp, out, mine
    # views at a different, unaligned offset on every rank (each rank publishes its own offset;
    # the line-by-line kernels need aligned outputs and leave such ones to the piece path)
    m = 17 * MiB // 4 // world * world
    big = fdist.shared_empty(m + 16, group=group)
    xs = [rank_data(r, m, torch.float32, 20) for r in range(world)]
    view = big[rank + 1 : rank + 1 + m]
    view.copy_(xs[rank])
    before = shm.mapped_ops
    group.all_reduce(view)
    check(view, summed(xs, torch.float32), "all_reduce on unaligned views", reduced=True)
    blk = m // world
    view[rank * blk : (rank + 1) * blk] = xs[rank][:blk]
    group.all_gather(view, view[rank * blk : (rank + 1) * blk])
    check(view, torch.cat([x[:blk] for x in xs]), "all_gather into unaligned views")
    mapped("unaligned views", before, expect=True)
    if shm.mapped_ops - before != 2:
        failures.append(f"unaligned views: {shm.mapped_ops - before} of 2 ops mapped")
    del big, view
    # async: mapped ops queued between slot ops
    n = 3 * MiB // 4 // world * world
    works, checks = [], []
    bufs = [fdist.shared_empty(n, group=group) for _ in range(3)]
    for i, b in enumerate(bufs):
        xs = [rank_data(r, n, torch.float32, 10 + i) for r in range(world)]
        b.copy_(xs[rank])
        works.append(group.all_reduce(b, async_op=True))
        checks.append((b, summed(xs, torch.float32), f"async all_reduce {i}"))
        small = xs[rank][:100].clone()
        works.append(group.all_reduce(small, async_op=True))
        checks.append((small, summed([x[:100] for x in xs], torch.float32), f"async small all_reduce {i}"))
    for w in works:
        w.wait()
    for got, want, what in checks:
        check(got, want, what, reduced=True)
    del bufs, checks, works, b
    live, maps, fds = _C._shared_live(), _mappings(), len(os.listdir("/proc/self/fd")) - fds_before
    group.destroy()
    return failures, digests, live, maps, fds


@pytest.mark.parametrize(
    "world,env",
    [
        (2, {}),
        (2, {"FAIRSCALE_C_SHM_DIRECT_MAX": "0"}),  # no process_vm_readv: mapped ops still map
        (3, {}),
        (4, {}),  # more ranks than this machine's 2 cores
    ],
    ids=["world2", "direct-reads-off", "world3", "world4"],
)
def test_collectives_on_shared_tensors(world, env):
    results = run_ranks(_ops_job, world, env={"FAIRSCALE_C_TIMEOUT": "120", **env}, timeout=600)
    for rank, (failures, _, live, maps, fds) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures}"
        assert live == 0 and maps == 0, f"rank {rank}: {live} allocations, {maps} mappings left after del"
        assert fds <= 0, f"rank {rank}: {fds} file descriptors more than before"
    digests = [d for _, d, _, _, _ in results]
    assert all(d == digests[0] for d in digests), "ranks got different all_reduce bits"


def _bad_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="shared-bad")
    errors = []
    for kwargs in [
        {"size": (4, 1000 + rank)},  # the ranks disagree: every rank raises
        {"size": (4,), "dtype": torch.float32 if rank == 0 else torch.float64},
        {"size": (-1,)},
        {"size": (2.5,)},
        {"size": (4,), "dtype": "float32"},
        {"size": (4,), "dtype": torch.complex64},
    ]:
        try:
            fdist.shared_empty(*kwargs["size"], dtype=kwargs.get("dtype", torch.float32), group=group)
            errors.append(None)
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    # the group still works afterwards
    t = fdist.shared_empty(2, 3, group=group)
    t.fill_(rank + 1)
    group.all_reduce(t)
    ok = t.shape == (2, 3) and bool((t == sum(range(1, world + 1))).all())
    # shared_zeros, what the features allocate with: shared on CPU for the collectives' dtypes,
    # ordinary zeros (and no warning) for others, and on other devices
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zs = [
            fdist.shared_zeros(5, dtype=dtype, device=device, group=group)
            for dtype, device in [(torch.bfloat16, "cpu"), (torch.complex64, "cpu"), (torch.float32, "meta")]
        ]
    zeros = [(fdist.is_shared(z), z.dtype, z.device.type, z.shape) for z in zs]
    ok = ok and bool((zs[0] == 0).all()) and bool((zs[1] == 0).all())
    group.destroy()
    return errors, ok, zeros


def test_bad_arguments_raise_on_every_rank():
    results = run_ranks(_bad_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    for rank, (errors, ok, zeros) in enumerate(results):
        assert ok, f"rank {rank}: the group did not work after the errors"
        assert zeros == [
            (True, torch.bfloat16, "cpu", (5,)),
            (False, torch.complex64, "cpu", (5,)),
            (False, torch.float32, "meta", (5,)),
        ], zeros
        size, dtype, negative, non_int, dtype_str, complex_dtype = errors
        assert size and "same size and dtype" in size and "(4, 1000)" in size and "(4, 1001)" in size, size
        assert dtype and "same size and dtype" in dtype and "torch.float64" in dtype, dtype
        assert negative and negative.startswith("ValueError") and "size[0] is -1" in negative, negative
        assert non_int and non_int.startswith("TypeError") and "size[0]" in non_int, non_int
        assert dtype_str and dtype_str.startswith("TypeError") and "dtype" in dtype_str, dtype_str
        assert complex_dtype and complex_dtype.startswith("TypeError") and "torch.complex64" in complex_dtype


class _LateReads:
    """A store whose reads come late: this rank reads an exchange's keys after its peers have."""

    def __init__(self, store) -> None:
        self._store = store

    def get(self, key):
        time.sleep(0.5)
        return self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _last_reader_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="shared-late")
    if rank == 1:
        group._exchange.store = _LateReads(group._exchange.store)
    t = fdist.shared_empty(4, group=group)
    # rank 0's process, which holds the store, ends here: its peer must have read everything by now
    return fdist.is_shared(t)


def test_no_rank_returns_before_every_rank_has_read_the_exchange():
    assert run_ranks(_last_reader_job, 2, env={"FAIRSCALE_C_TIMEOUT": "30"}) == [True, True]


def test_one_rank_gets_an_ordinary_tensor():
    import fairscale_c.distributed as fdist

    t = fdist.shared_empty(3, 4, dtype=torch.float64, group=fdist.LocalGroup())
    assert t.shape == (3, 4) and t.dtype == torch.float64 and bool((t == 0).all())
    assert not fdist.is_shared(t)
    with pytest.raises(TypeError, match="shared_empty: group is object; expected a fairscale_c.distributed Group"):
        fdist.shared_empty(3, group=object())
    z = fdist.shared_zeros(4, dtype=torch.float32, device="cpu", group=fdist.LocalGroup())
    assert z.shape == (4,) and bool((z == 0).all()) and not fdist.is_shared(z)
    with pytest.raises(TypeError, match="shared_zeros: group is NoneType; expected a fairscale_c.distributed Group"):
        fdist.shared_zeros(4, dtype=torch.float32, device="cpu", group=None)
    with pytest.raises(ValueError, match="shared_zeros: numel is -1; expected an int >= 0"):
        fdist.shared_zeros(-1, dtype=torch.float32, device="cpu", group=fdist.LocalGroup())
    with pytest.raises(TypeError, match="shared_zeros: numel is 2.5"):
        fdist.shared_zeros(2.5, dtype=torch.float32, device="cpu", group=fdist.LocalGroup())
