"""fairscale_c.distributed's torch.distributed-shaped surface: module functions that take a torch
process group, torch's ReduceOp, send/recv in torch's positional order (recv returning the
sender), isend/irecv, P2POps that name their group, Work.wait with a timedelta; and the one-rank
LocalGroup refusing every argument the engine refuses, with the engine's messages."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import join_gloo, run_ranks


BAD_CALLS = {
    "unknown op": lambda g: g.all_reduce(torch.ones(4), op="prod"),
    "avg on ints": lambda g: g.all_reduce(torch.ones(4, dtype=torch.int32), op="avg"),
    "not a tensor": lambda g: g.all_reduce([1.0, 2.0]),
    "None": lambda g: g.broadcast(None),
    "non-contiguous": lambda g: g.all_reduce(torch.ones(4, 4).t()),
    "complex": lambda g: g.all_reduce(torch.ones(4, dtype=torch.complex64)),
    "int16": lambda g: g.all_reduce(torch.ones(4, dtype=torch.int16)),
    "requires grad": lambda g: g.all_reduce(torch.ones(4, requires_grad=True)),
    "reduce unknown op": lambda g: g.reduce(torch.ones(4), root=0, op="bogus"),
    "reduce_scatter unknown op": lambda g: g.reduce_scatter(torch.empty(4), torch.ones(4), op="bogus"),
    "all_gather dtypes": lambda g: g.all_gather(torch.empty(4, dtype=torch.float64), torch.ones(4)),
    "all_gather sizes": lambda g: g.all_gather(torch.empty(3), torch.ones(4)),
    "reduce_scatter sizes": lambda g: g.reduce_scatter(torch.empty(2), torch.ones(4)),
    "overlap": lambda g: (lambda t: g.all_gather(t[:4], t[2:6]))(torch.ones(8)),
    "root": lambda g: g.broadcast(torch.ones(2), root=1),
    "huge root": lambda g: g.reduce(torch.ones(2), root=2**40),
    "ReduceOp.PRODUCT": lambda g: g.all_reduce(torch.ones(2), op=torch.distributed.ReduceOp.PRODUCT),
    "batch item": lambda g: g.batch([("all_reduce", torch.ones(2), "prod")]),
    "read-only": lambda g: (lambda a: (a.setflags(write=False), g.all_reduce(a)))(torch.ones(2).numpy()),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_one_rank_group_refuses_what_the_engine_refuses(solo, case):
    import fairscale_c.distributed as fdist

    local = fdist.LocalGroup()
    errors = []
    for g in (solo, local):
        with pytest.raises((TypeError, ValueError)) as info:
            BAD_CALLS[case](g)
        errors.append((info.type, str(info.value)))
    assert errors[0] == errors[1], errors


def test_one_rank_group_still_copies():
    import fairscale_c.distributed as fdist

    g = fdist.LocalGroup()
    out, x = torch.empty(3), torch.arange(3.0)
    g.all_gather(out, x)
    assert out.tolist() == [0.0, 1.0, 2.0]
    g.reduce_scatter(out, x * 2, op=torch.distributed.ReduceOp.SUM)
    assert out.tolist() == [0.0, 2.0, 4.0]
    copied = torch.empty(3)
    assert g.batch([("copy", copied, x), ("all_reduce", x, "max")], async_op=True).wait()
    assert copied.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="has one rank, so there is no peer"):
        g.batch([fdist.P2POp("send", x, 0)])


def _torch_shaped_job(rank: int, world: int):
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    join_gloo(rank, world)
    pg, peer = dist.group.WORLD, 1 - rank
    fdist.init_group()
    # a torch process group as `group`, torch's ReduceOp as `op`
    t = torch.tensor([float(rank), 5.0 - rank])
    fdist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    assert t.tolist() == [1.0, 5.0], t
    t = torch.full((2,), float(rank))
    fdist.reduce(t, 0, dist.ReduceOp.AVG, pg)
    assert rank != 0 or t.tolist() == [0.5, 0.5], t
    with pytest.raises(ValueError, match=r"expected one of 'sum', 'avg', 'max', 'min' or their ReduceOp"):
        fdist.all_reduce(t, op=dist.ReduceOp.BAND, group=pg)
    with pytest.raises(TypeError, match=r"argument 'group' must be a fairscale_c.distributed group"):
        fdist.barrier(group=object())
    # send / recv in torch's positional order (tensor, peer, group, tag); recv returns the sender
    x, y = torch.full((3,), 10.0 + rank), torch.empty(3)
    if rank == 0:
        fdist.send(x, 1, pg, 7)
        assert fdist.recv(y, 1, None, 8) == 1
    else:
        assert fdist.recv(y, 0, pg, 7) == 0
        fdist.send(x, 0, None, 8)
    assert y.tolist() == [10.0 + peer] * 3, y
    # isend / irecv both first, on both ranks, and waits with a timedelta as torch's take
    y = torch.empty(3)
    works = [fdist.irecv(y, peer, pg, 3), fdist.isend(x, peer, pg, 3)]
    assert all(w.wait(datetime.timedelta(seconds=30)) for w in works)
    assert y.tolist() == [10.0 + peer] * 3, y
    # P2POps that name their group, as torch's batch_isend_irecv takes them (recv listed first)
    y = torch.empty(3)
    ops = [fdist.P2POp(fdist.irecv, y, peer, group=pg), fdist.P2POp(fdist.isend, x, peer, group=pg)]
    for w in fdist.batch_isend_irecv(ops):
        w.wait()
    assert y.tolist() == [10.0 + peer] * 3, y
    other = fdist.init_group(name="other")
    with pytest.raises(ValueError, match=r"every P2POp of a batch must name its group or none"):
        other.batch([fdist.P2POp("send", x, peer, group=fdist.get_group())])
    other.destroy()
    dist.barrier()
    return True


def _torch_subgroup_job(rank: int, world: int):
    """With a torch.distributed subgroup as `group`, the module functions take (and recv returns)
    global ranks, as torch.distributed's do."""
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    join_gloo(rank, world)
    sub = dist.new_group([1, 2])  # every rank calls it; rank 0 is not a member
    if rank == 0:
        dist.barrier()
        return True
    peer = 3 - rank  # the other member's global rank
    t = torch.full((2,), float(rank))
    fdist.broadcast(t, 2, group=sub)  # from global rank 2
    assert t.tolist() == [2.0, 2.0], t
    t = torch.full((2,), float(rank))
    fdist.reduce(t, 1, group=sub)  # onto global rank 1
    assert rank != 1 or t.tolist() == [3.0, 3.0], t
    x, y = torch.full((3,), 10.0 + rank), torch.empty(3)
    if rank == 1:
        fdist.send(x, 2, sub)
        assert fdist.recv(y, 2, sub) == 2
    else:
        assert fdist.recv(y, 1, sub) == 1
        fdist.send(x, 1, sub)
    assert y.tolist() == [10.0 + peer] * 3, y
    y = torch.empty(3)
    works = [fdist.irecv(y, peer, sub), fdist.isend(x, peer, sub)]
    assert all(w.wait() for w in works) and y.tolist() == [10.0 + peer] * 3, y
    y = torch.empty(3)
    ops = [fdist.P2POp(fdist.irecv, y, peer, group=sub), fdist.P2POp(fdist.isend, x, peer, group=sub)]
    for w in fdist.batch_isend_irecv(ops):
        w.wait()
    assert y.tolist() == [10.0 + peer] * 3, y
    with pytest.raises(ValueError, match=r"broadcast: root=0 is not a rank of the process group.*\[1, 2\]"):
        fdist.broadcast(t, 0, group=sub)
    with pytest.raises(TypeError, match=r"send: argument 'dst' must be an int \(a global rank\)"):
        fdist.send(x, "1", sub)
    dist.barrier()
    return True


def _torch_code_job(rank: int, world: int):
    """Calls written for torch.distributed: group=None is every rank even when a subgroup's engine
    group was built first; a non-member's NON_GROUP_MEMBER makes a call do nothing; src=/dst=
    keywords; the list forms of all_gather and reduce_scatter and the *_tensor names."""
    import warnings

    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    join_gloo(rank, world)
    sub = dist.new_group([0, 1])  # NON_GROUP_MEMBER on rank 2
    x = torch.ones(2)
    if rank < 2:
        fdist.all_reduce(x, group=sub)  # builds the subgroup's engine group first
        assert x.tolist() == [2.0, 2.0], x
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert fdist.all_reduce(x, group=sub) is None and fdist.recv(x, 0, sub) == -1
            assert fdist.batch_isend_irecv([fdist.P2POp("send", x, 0, group=sub)]) == []  # as torch
        assert x.tolist() == [1.0, 1.0] and "not in the process group" in str(caught[0].message)
    t = torch.full((2,), float(rank + 1))
    fdist.all_reduce(t)  # every rank, as torch's group=None
    assert t.tolist() == [6.0, 6.0], t
    t = torch.full((1,), float(rank))
    fdist.broadcast(t, src=1)
    assert t.tolist() == [1.0], t
    t = torch.ones(1)
    fdist.reduce(t, dst=2)
    assert rank != 2 or t.tolist() == [3.0], t
    outs = [torch.empty(2) for _ in range(world)]
    fdist.all_gather(outs, torch.full((2,), float(rank)))
    assert [o.tolist() for o in outs] == [[float(r)] * 2 for r in range(world)], outs
    for w in [fdist.all_gather(outs, torch.full((2,), 10.0 + rank), async_op=True)]:
        w.wait()
    assert [o[0].item() for o in outs] == [10.0 + r for r in range(world)], outs
    out = torch.empty(2)
    fdist.reduce_scatter(out, [torch.full((2,), float(r)) for r in range(world)])
    assert out.tolist() == [3.0 * rank] * 2, out
    with pytest.raises(TypeError, match=r"argument 'op' must be one of 'sum'.* got float"):
        fdist.all_reduce(t, 3.5)
    with pytest.raises(TypeError, match=r"ops\[0\] must be a fairscale_c.distributed.P2POp .*torch.distributed"):
        fdist.batch_isend_irecv([dist.P2POp(dist.isend, t, (rank + 1) % world)])
    flat = torch.empty(2 * world)
    fdist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    fdist.reduce_scatter_tensor(out, flat)
    assert out.tolist() == [3.0 * rank] * 2, out
    dist.barrier()
    return True


def test_code_written_for_torch_distributed():
    assert run_ranks(_torch_code_job, 3, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [True] * 3


def _wait_timeout_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    g = fdist.init_group()
    if rank == 0:
        got = torch.zeros(1)
        work = fdist.irecv(got, 1, g)
        with pytest.raises(Exception, match=r"recv did not complete within 0.5 s"):
            work.wait(timeout=0.5)
    if rank == 1:
        time.sleep(2.0)  # after rank 0's wait gave up
        fdist.send(torch.ones(1), 0, g)
    else:
        assert work.wait() and got.item() == 1.0  # the op went on after the timed-out wait
    g.destroy()
    return True


def test_a_timed_out_wait_says_how_long_it_waited():
    assert run_ranks(_wait_timeout_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [True] * 2


def test_torch_subgroup_ranks_are_global_ranks():
    assert run_ranks(_torch_subgroup_job, 3, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [True] * 3


def test_torch_shaped_module_functions():
    assert run_ranks(_torch_shaped_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [True, True]


def _reinit_job(rank: int, world: int):
    """group=None across destroy_process_group / init_process_group: it follows the current world,
    as torch's does, also after a feature built the new world's engine group (which releases the
    old one); destroying the shared group says so in the error the features then get."""
    import os

    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    torch.set_num_threads(1)
    base = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0)
    sums = []
    for cycle, solo in enumerate((False, False, True)):
        if solo:  # each process a world of its own
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"c{cycle}", base), rank=rank, world_size=world)
            if cycle:
                fdist.group_for(dist.group.WORLD)  # as FSDP / OSS do at construction
        t = torch.ones(2)
        fdist.all_reduce(t)
        sums.append(t[0].item())
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("shared", base), rank=rank, world_size=world)
    shared = fdist.group_for(dist.group.WORLD)
    with fdist.init_group() as group:
        assert group is shared
    try:
        shared.all_reduce(torch.ones(2))
        message = ""
    except RuntimeError as e:
        message = str(e)
    base.set(f"done{rank}", "1")
    base.wait([f"done{r}" for r in range(world)])
    dist.destroy_process_group()
    try:  # no world now: torch's None is refused too (not a rendezvous on the old store's port)
        fdist.all_reduce(torch.ones(2))
        after = ""
    except RuntimeError as e:
        after = str(e)
    return sums, message, after


def test_group_none_follows_the_current_world_across_reinitialisation():
    for sums, message, after in run_ranks(_reinit_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120):
        assert sums == [2.0, 2.0, 1.0], sums
        assert "has been destroyed" in message and "init_group(name=...)" in message, message
        assert "destroy_process_group" in after and "not initialised" in after, after


def _store_keys_job(rank: int, world: int):
    import torch.distributed as dist

    import fairscale_c.distributed as fdist
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    join_gloo(rank, world)
    store = dist.distributed_c10d._get_default_store()
    FSDP(torch.nn.Linear(8, 8))  # builds the engine groups FSDP shares
    dist.barrier()
    before = store.num_keys()
    for i in range(5):
        FSDP(torch.nn.Linear(8, 8))  # its shards in shared memory: two exchanges each
        fdist.init_group(name=f"mine{i}").destroy()
    dist.barrier()
    grown = store.num_keys() - before
    dist.barrier()  # the store lives in rank 0: it must not exit before rank 1 has read it
    dist.destroy_process_group()
    return grown


def test_rendezvous_keys_are_deleted_once_every_rank_has_read_them():
    # A job that builds wrappers, groups or shared tensors over and over must not grow the store
    # (which lives in rank 0's process, or in torchrun's agent) by a few keys each time. (torch
    # may drop a key of its own meanwhile: the count must not grow.)
    grown = run_ranks(_store_keys_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert all(n <= 0 for n in grown), grown


def _torch_groups_in_any_order_job(rank: int, world: int, threaded: bool):
    """Two torch groups over the same ranks, first used in a different order on each rank: each
    rank's engine group meets the same torch group's on the others. From one thread per group
    (which torch allows) this works; from one thread with async ops (which torch also allows,
    its groups being built in new_group) the first op's build waits for the peer's: an error at
    the timeout, never one group's data summed with the other's."""
    import threading

    import fairscale_c.distributed as fdist

    join_gloo(rank, world)
    pg_a, pg_b = dist.new_group([0, 1]), dist.new_group([0, 1])
    a, b = torch.full((4,), 1.0), torch.full((4,), 100.0)
    order = [(pg_a, a), (pg_b, b)] if rank == 0 else [(pg_b, b), (pg_a, a)]
    if threaded:
        threads = []
        for pg, t in order:
            threads.append(threading.Thread(target=fdist.all_reduce, args=(t,), kwargs={"group": pg}))
            threads[-1].start()
            time.sleep(0.2)
        for t in threads:
            t.join(60)
        return a[0].item(), b[0].item()
    try:
        for w in [fdist.all_reduce(t, group=pg, async_op=True) for pg, t in order]:
            w.wait()
    except fdist.DistributedError:
        return "DistributedError"
    return a[0].item(), b[0].item()


def test_torch_groups_over_the_same_ranks_first_used_in_any_order():
    env = {"FAIRSCALE_C_TIMEOUT": "60"}
    assert run_ranks(_torch_groups_in_any_order_job, 2, True, env=env) == [(2.0, 200.0)] * 2
    env = {"FAIRSCALE_C_TIMEOUT": "3"}
    assert run_ranks(_torch_groups_in_any_order_job, 2, False, env=env) == ["DistributedError"] * 2


def _first_use_from_two_threads_job(rank: int, world: int):
    """Two threads whose first op runs at once build one engine group for the default group."""
    import threading

    import fairscale_c.distributed as fdist
    from fairscale_c.distributed import _group

    join_gloo(rank, world)
    go = threading.Barrier(2)
    threads = [threading.Thread(target=lambda: (go.wait(), fdist.all_reduce(torch.ones(8)))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    same = fdist.get_group() is fdist.group_for(dist.group.WORLD)
    live = len(_group._LIVE)
    fdist.destroy()
    return same, live, len(_group._LIVE)


def test_a_group_first_used_by_two_threads_at_once_is_built_once():
    for _ in range(3):  # a race: a few tries
        assert run_ranks(_first_use_from_two_threads_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [(True, 1, 0)] * 2


def _torch_semantics_job(rank: int, world: int):
    """What torch.distributed's functions accept, these do too, and what gloo refuses, they refuse."""
    import fairscale_c.distributed as fdist

    join_gloo(rank, world)
    results = {}
    # a Parameter (it requires grad): broadcast into its memory, as torch does
    p = torch.nn.Parameter(torch.full((3,), float(rank)))
    fdist.broadcast(p, 0)
    outs = [torch.nn.Parameter(torch.zeros(3)) for _ in range(world)]
    fdist.all_gather(outs, p)
    results["parameter"] = (p.tolist(), [o.tolist() for o in outs], p.requires_grad)
    # an empty tensor torch calls contiguous whatever its strides
    empty = torch.zeros(0, 3)[:, ::2]
    assert empty.is_contiguous()
    fdist.all_reduce(empty)
    # list outputs of another dtype or shape than the input: gloo refuses them
    for bad in ([torch.zeros(3, dtype=torch.int64) for _ in range(world)], [torch.zeros(2, 3) for _ in range(world)]):
        wrong = r"all_gather: output\[0\] must be a tensor of the input's dtype and shape"
        with pytest.raises(ValueError, match=wrong):
            fdist.all_gather(bad, torch.ones(3))
    # a P2POp naming another group than the batch's
    other = dist.new_group([0, 1])
    op = fdist.P2POp("send" if rank == 0 else "recv", torch.ones(2), 1 - rank, group=other)
    with pytest.raises(ValueError, match="names another group than argument 'group'"):
        fdist.batch_isend_irecv([op], group=dist.group.WORLD)
    # one P2POp naming a group, one none (the default group): torch refuses such a batch too
    unnamed = fdist.P2POp("recv" if rank == 0 else "send", torch.ones(2), 1 - rank)
    with pytest.raises(ValueError, match="the P2POps name different groups"):
        fdist.batch_isend_irecv([op, unnamed])
    # a torch group and its engine group are one group, either way round
    for given, named in ((other, fdist.group_for(other)), (fdist.group_for(other), other)):
        got = torch.zeros(2)
        ops = [
            fdist.P2POp("send", torch.full((2,), float(rank)), 1 - rank, group=named),
            fdist.P2POp("recv", got, 1 - rank, group=named),
        ]
        for w in fdist.batch_isend_irecv(ops, group=given):
            w.wait()
        assert got.tolist() == [float(1 - rank)] * 2
    with pytest.raises(ValueError, match=r"src=5 is not a rank"):
        fdist.broadcast(torch.ones(2), src=5, group=dist.group.WORLD)
    with pytest.raises(TypeError, match="new_group: argument 'group' must be a fairscale_c.distributed Group"):
        fdist.new_group([0, 1], group=dist.group.WORLD)
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        fdist.all_reduce(torch.ones(2, dtype=torch.complex64))
    dist.barrier()
    return results


def test_torch_distributed_semantics_of_the_module_functions():
    got = run_ranks(_torch_semantics_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    for r in got:
        assert r["parameter"] == ([0.0] * 3, [[0.0] * 3] * 2, True)


def _subgroup_orders_job(rank: int, world: int):
    import fairscale_c.distributed as fdist

    join_gloo(rank, world)
    group = fdist.init_group()
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"in different orders \(rank 0: \[0,1\]; rank 1: \[1,0\]\)"):
        group.new_group([0, 1] if rank == 0 else [1, 0])
    waited = time.monotonic() - started
    sub = group.new_group([1, 0])  # the group goes on: the same list on every rank
    t = torch.full((1,), float(rank))
    sub.broadcast(t, root=0)  # subgroup rank 0 is group rank 1
    return waited, t.item()


def test_subgroup_ranks_given_in_different_orders_are_refused_at_once():
    for waited, value in run_ranks(_subgroup_orders_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}):
        assert waited < 30 and value == 1.0, (waited, value)
