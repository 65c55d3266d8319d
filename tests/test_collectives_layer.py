"""The collectives layer as features use it: point-to-point that cannot deadlock (ring exchanges
in every order, sync and async, single ops and batches), the overlap rule for every op, one engine
group per torch process group and role, and Work on CUDA (GPU-marked)."""

import os

import pytest
import torch

from dist_utils import run_ranks, orphaned_segments

FAST = {"FAIRSCALE_C_TIMEOUT": "30"}
SMALL = 1000  # elements: one p2p chunk, so a send completes without its receiver
LARGE = 300_000  # 1.2 MB of float32: five 256 KiB chunks, more than the two buffers of a channel

# How each rank issues its send (to the right) and its recv (from the left):
#   send_first / recv_first: every rank in that order; by_rank: even ranks send first.
ORDERS = ["send_first", "recv_first", "by_rank"]


@pytest.fixture(autouse=True)
def _no_leaked_segments():
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


def _ring_job(rank, world, cases, device="cpu"):
    import fairscale_c.distributed as fdist

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    right, left = (rank + 1) % world, (rank - 1) % world
    failures = []
    with fdist.init_group(name="ring") as g:
        for (mode, order, n), step in (
            (c, s) for c in cases for s in range(3)
        ):  # several rounds: channels carry message after message
            out = (torch.arange(n, dtype=torch.float32) + 1000 * rank + step).to(device)
            got = torch.full((n,), -1.0, device=device)
            send_first = order == "send_first" or (order == "by_rank" and rank % 2 == 0)
            ops = [fdist.P2POp("send", out, right), fdist.P2POp(fdist.recv, got, left)]
            if not send_first:
                ops.reverse()
            if mode == "batch":
                g.batch(ops)
            elif mode == "batch_async":
                work = fdist.batch_isend_irecv(ops, group=g)
                for w in work:
                    w.wait()
            elif mode == "async":
                works = [
                    g.send(o.tensor, o.peer, async_op=True)
                    if o.op == "send"
                    else g.recv(o.tensor, o.peer, async_op=True)
                    for o in ops
                ]
                for w in reversed(works):  # waiting out of order is fine too
                    w.wait()
            else:  # sync single ops: a small send completes once it is in the shared buffer
                for o in ops:
                    (g.send if o.op == "send" else g.recv)(o.tensor, o.peer)
            want = (torch.arange(n, dtype=torch.float32) + 1000 * left + step).to(device)
            if not torch.equal(got, want):
                failures.append(f"{mode}/{order} step {step}: got {got[:4].tolist()}..., want {want[:4].tolist()}...")
        g.barrier()
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_exchange_completes_in_any_order(world):
    # Batches and async ops complete in every order and at every size. Single sync ops complete
    # when a sender comes first: a small send completes once its data is in the shared buffer.
    # (Every rank blocking in a sync recv first can complete with no implementation.)
    cases = [(m, o, n) for m in ("async", "batch", "batch_async") for o in ORDERS for n in (SMALL, LARGE)]
    cases += [("sync", o, SMALL) for o in ("send_first", "by_rank")]
    results = run_ranks(_ring_job, world, cases, env=FAST, timeout=240)
    assert not any(results), results


def _shared_p2p_job(rank, world, n):
    import fairscale_c.distributed as fdist

    peer = 1 - rank
    with fdist.init_group(name="shared-p2p") as g:
        src = fdist.shared_empty((2, n), group=g)  # every rank maps it: the receiver copies the peer's row itself
        src[rank] = torch.arange(n, dtype=torch.float32) + 7 * rank
        got = torch.empty(n)
        g.batch([fdist.P2POp("send", src[rank], peer), fdist.P2POp("recv", got, peer)])
        one_way = torch.empty(n)
        if rank == 0:
            g.send(src[0][1:], 1)
        else:
            g.recv(one_way[1:], 0)
        g.barrier()
        ok = torch.equal(got, torch.arange(n, dtype=torch.float32) + 7 * peer)
        if rank == 1:
            ok = ok and torch.equal(one_way[1:], torch.arange(1, n, dtype=torch.float32))
        return ok


@pytest.mark.parametrize("direct", ["on", "off"])
def test_large_messages_from_shared_tensors(direct):
    """A message of more than two chunks sent from a shared tensor is copied by the receiver from
    its own mapping of it (one copy, shm_p2p.c), in a batch and alone; with direct reads off
    (FAIRSCALE_C_SHM_DIRECT_MAX=0) it goes through the channel's buffers."""
    env = {**FAST, **({"FAIRSCALE_C_SHM_DIRECT_MAX": "0"} if direct == "off" else {})}
    assert run_ranks(_shared_p2p_job, 2, LARGE, env=env) == [True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ring_exchange_batches_complete_in_any_order_on_nccl():
    """On NCCL only a batch (one ncclGroupStart/End) makes the order of a pair's sends and receives
    free: a communicator runs a rank's operations in issue order and a large send does not finish
    before its receive has started (docs/collectives.md). 4 MiB messages are beyond what NCCL
    buffers."""
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    cases = [(m, o, n) for m in ("batch", "batch_async") for o in ORDERS for n in (SMALL, 1 << 20)]
    results = run_ranks(_ring_job, 2, cases, "cuda", env={**FAST, **nccl_env}, timeout=240)
    assert not any(results), results


def _send_ahead_job(rank, world, k, n):
    import fairscale_c.distributed as fdist

    peer = 1 - rank
    with fdist.init_group(name="ahead") as g:
        works = [g.send(torch.full((n,), float(10 * rank + i)), peer, async_op=True) for i in range(k)]
        got = []
        for _ in range(k):  # one synchronous recv at a time, while this rank's own sends wait for room
            out = torch.empty(n)
            g.recv(out, peer)
            got.append(float(out[0]))
        for w in works:
            w.wait()
    return got


@pytest.mark.parametrize("k,n", [(5, 100), (4, LARGE)])
def test_recvs_complete_behind_this_ranks_pending_sends(k, n):
    """Both ranks isend more messages than a channel holds, then recv them one by one: a recv
    completes while an earlier send of its own rank still waits for room (which only the peer's
    next recv makes), so neither rank waits for the other."""
    results = run_ranks(_send_ahead_job, 2, k, n, env=FAST)
    assert results == [[10.0 + i for i in range(k)], [float(i) for i in range(k)]]


def _overlap_job(rank, world):
    import fairscale_c.distributed as fdist

    messages = []
    with fdist.init_group(name="overlap") as g:
        buf = torch.zeros(8 * world)
        cases = [
            ("all_gather", lambda: g.all_gather(buf[: 4 * world], buf[1:5])),
            ("reduce_scatter", lambda: g.reduce_scatter(buf[1:5], buf[: 4 * world])),
            ("batch", lambda: g.batch([("send", buf[:4], (rank + 1) % world), ("recv", buf[2:6], (rank - 1) % world)])),
        ]
        for what, call in cases:
            try:
                call()
                messages.append(f"{what}: overlapping arguments accepted")
            except ValueError as e:
                if "overlaps" not in str(e) and "also uses" not in str(e):
                    messages.append(f"{what}: unclear message {e}")
        # the in-place forms stay allowed
        per = 4
        g.all_gather(buf[: per * world], buf[rank * per : (rank + 1) * per])
        g.reduce_scatter(buf[rank * per : (rank + 1) * per], buf[: per * world])
        g.barrier()
    return messages


def test_overlapping_arguments_are_refused_for_every_op():
    results = run_ranks(_overlap_job, 2, env=FAST)
    assert results == [[], []], results


def _progress_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("fsc_progress")


def _one_group_job(rank, world):
    import torch.distributed as dist

    import fairscale_c.distributed as fdist
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.optim.grad_scaler import ShardedGradScaler

    dist.init_process_group("gloo")
    try:
        model = FSDP(torch.nn.Sequential(FSDP(torch.nn.Linear(4, 4)), torch.nn.Linear(4, 4)))
        scaler = ShardedGradScaler()
        default = fdist.init_group()
        checks = {
            "FSDP's group is the registry's": model.comm is fdist.group_for(None),
            "init_group() returns it": default is model.comm,
            "nested instances share it": all(m.comm is model.comm for m in model.modules() if isinstance(m, FSDP)),
            "reduce-scatter role is its own group": model.comm_rs is fdist.group_for(None, "reduce_scatter")
            and model.comm_rs is not model.comm,
            "the scaler uses it": scaler._group_comm() is model.comm,
        }
        threads = _progress_threads()
        default.destroy()
        model.comm_rs.destroy()
        return [k for k, ok in checks.items() if not ok], threads
    finally:
        dist.destroy_process_group()


def test_one_engine_group_per_torch_group_and_role():
    results = run_ranks(_one_group_job, 2, env=FAST)
    for failed, threads in results:
        assert failed == []
        assert threads == 2, f"{threads} progress threads; expected one per (torch group, role): 2"


def _released_job(rank, world):
    import gc
    import weakref

    import torch.distributed as dist

    import fairscale_c.distributed as fdist
    from fairscale_c.distributed import _group
    from fairscale_c.optim import OSS

    dist.init_process_group("gloo")
    try:
        sub = dist.new_group(list(range(world)))
        model = torch.nn.Linear(8, 4)
        opt = OSS(model.parameters(), lr=0.1, group=sub)  # the first group built: the module's default
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        group = fdist.group_for(sub)
        dist.destroy_process_group(sub)
        alive = weakref.ref(sub)
        del sub, opt, model
        _group._close_live_groups()  # what runs at interpreter exit
        gc.collect()
        with pytest.raises(RuntimeError, match="has been destroyed"):
            group.new_group([0])
        return alive() is None
    finally:
        dist.destroy_process_group()


def test_closed_groups_let_go_of_their_torch_group():
    """At exit, the engine's groups are closed before the interpreter finalizes; a torch group
    that torch has destroyed must then end there (its gloo threads joined), not during
    finalization, where a gloo thread still releasing a finished work aborts the process."""
    assert run_ranks(_released_job, 2, env=FAST) == [True, True]


def _shared_gpu_job(rank, world, scenario):
    import fairscale_c.distributed as fdist
    from fairscale_c.distributed import _group

    # stand-in for CUDA: the device UUID each rank's current GPU would report
    _group.gpu_identity = lambda: {"same": "GPU-0", "different": f"GPU-{rank}", "none": None}[scenario]
    with fdist.init_group(name="gpus") as g:
        return g.shares_gpu, fdist.ranks_share_gpus(g)


@pytest.mark.parametrize("scenario,shared", [("same", True), ("different", False), ("none", False)])
def test_ranks_on_one_gpu_are_found_at_rendezvous(scenario, shared):
    """Ranks whose current CUDA device is one GPU (started without torchrun, so without
    LOCAL_WORLD_SIZE) are told so by the group; FSDP then keeps one NCCL communicator."""
    env = {**FAST, "LOCAL_WORLD_SIZE": ""}
    assert run_ranks(_shared_gpu_job, 2, scenario, env=env) == [(shared, shared)] * 2


def _real_gpu_job(rank, world):
    import fairscale_c.distributed as fdist

    torch.cuda.set_device(0)
    torch.cuda.init()
    with fdist.init_group(name="real-gpus") as g:
        return g.shares_gpu, fdist.ranks_share_gpus(g)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ranks_on_one_real_gpu_are_found_at_rendezvous():
    """The same as above with the device's own UUID: two ranks on cuda:0."""
    env = {**FAST, "LOCAL_WORLD_SIZE": ""}
    assert run_ranks(_real_gpu_job, 2, env=env) == [(True, True)] * 2


def test_gpus_shared_compares_host_and_device():
    from fairscale_c.distributed._group import _gpus_shared

    assert _gpus_shared([{"host": "a", "gpu": "GPU-0"}, {"host": "a", "gpu": "GPU-0"}])
    assert not _gpus_shared([{"host": "a", "gpu": "GPU-0"}, {"host": "b", "gpu": "GPU-0"}])
    assert not _gpus_shared([{"host": "a", "gpu": None}, {"host": "a", "gpu": None}])
    assert not _gpus_shared([{"host": "a", "gpu": "GPU-0"}, {"host": "a", "gpu": "GPU-1"}])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_work_completes_with_its_event():
    results = run_ranks(_cuda_work_job, 1, env=FAST)
    assert results == [[]], results


def _cuda_work_job(rank, world):
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    try:
        g = fdist.init_group(name="cuda-work", device=torch.device("cuda", 0))
        t = torch.ones(1 << 20, device="cuda")
        torch.cuda._sleep(200_000_000)  # the op is queued behind this on the current stream
        work = g.all_reduce(t, async_op=True)
        problems = []
        if work.is_completed():
            problems.append("is_completed() before the op could run")
        work.wait()  # the current stream waits; the host does not
        torch.cuda.synchronize()
        if not work.is_completed():
            problems.append("not completed after synchronize")
        g.destroy()
        return problems
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ops_keep_issue_order_across_streams():
    """Synchronous CUDA ops run on the caller's current stream, asynchronous ones on the group's
    side stream: a synchronous op issued while an asynchronous one still runs, and ops issued
    from another stream, still run after the group's previous op, and the caller's later work on
    its stream sees their results without a host synchronisation."""
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    results = run_ranks(_stream_order_job, 2, env={**FAST, **nccl_env}, timeout=240)
    assert results == [[]] * 2, results


def _stream_order_job(rank, world):
    import fairscale_c.distributed as fdist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    problems = []
    with fdist.init_group(name="stream-order", device=torch.device("cuda", torch.cuda.current_device())) as g:
        for step in range(3):
            big = torch.full((1 << 24,), float(rank + 1), device="cuda")
            torch.cuda._sleep(50_000_000)  # the async op waits behind this
            work = g.all_reduce(big, async_op=True)
            small = torch.full((4,), float(rank + 1 + step), device="cuda")
            g.all_reduce(small)  # on the current stream, after the async op
            doubled = small * 2  # the caller's next kernel sees the sum
            other = torch.cuda.Stream()
            with torch.cuda.stream(other):
                x = torch.full((8,), float(10 * (rank + 1)), device="cuda")
                g.all_reduce(x)  # another stream: after the op before it
                y = torch.full((8,), float(rank), device="cuda")
                g.broadcast(y, 1)
            torch.cuda.current_stream().wait_stream(other)
            work.wait()
            torch.cuda.synchronize()
            want = {
                "big": float(1 + 2), "doubled": 2.0 * (1 + step + 2 + step), "x": 30.0, "y": 1.0,
            }  # fmt: skip
            for name, t in (("big", big), ("doubled", doubled), ("x", x), ("y", y)):
                if not bool((t == want[name]).all()):
                    problems.append(f"step {step}: {name} = {t.unique().tolist()}, want {want[name]}")
    return problems


def test_local_group_batch_and_point_to_point():
    import fairscale_c.distributed as fdist

    g = fdist.LocalGroup()
    out, inp = torch.zeros(4), torch.arange(4.0)
    assert g.batch([("all_gather", out, inp), ("all_reduce", out, "sum")], async_op=True).is_completed()
    assert torch.equal(out, inp)
    with pytest.raises(ValueError, match="one rank, so there is no peer to send"):
        g.send(inp, 0)
    with pytest.raises(ValueError, match="no peer to recv"):
        g.batch([fdist.P2POp("recv", out, 0)])
    with pytest.raises(TypeError, match="argument 'ops' must be a sequence of P2POp or tuples"):
        g.batch(5)


def _nccl_dtypes_and_nan_job(rank, world):
    """int8 / int16 / bool through NCCL's copying ops, max/min with a NaN against
    torch.distributed's NCCL backend on the same tensors: NCCL's max and min drop a NaN where the
    CPU engine propagates it (docs/collectives.md), and on CUDA we give what torch gives; and the
    gradients' infinity norm, which must stay NaN on every rank. Returns
    the failures and, per op and NaN rank, whether the result kept the NaN."""
    import math

    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl")
    failures, kept = [], {}
    with fdist.init_group(name="nccl-dtypes") as g:
        for dtype in (torch.int8, torch.int16, torch.bool):
            x = (torch.arange(999, device="cuda") * (rank + 3) % 7 > 2).to(dtype)
            out = torch.empty(999 * world, dtype=dtype, device="cuda")
            g.all_gather(out, x)
            want = torch.cat([(torch.arange(999, device="cuda") * (r + 3) % 7 > 2).to(dtype) for r in range(world)])
            if not torch.equal(out, want):
                failures.append(f"all_gather {dtype}")
            b = x.clone()
            g.broadcast(b, root=1)
            if not torch.equal(b, want[999:]):
                failures.append(f"broadcast {dtype}")
            got = torch.empty_like(x)
            g.batch([("send", x, 1 - rank), ("recv", got, 1 - rank)])
            if not torch.equal(got, want[999 * (1 - rank) : 999 * (2 - rank)]):
                failures.append(f"send/recv {dtype}")
        for op, torch_op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for nan_rank in range(world):
                    t = (torch.tensor([1.0, 2.0, 3.0], device="cuda") * (rank + 1)).to(dtype)
                    if rank == nan_rank:
                        t[0] = float("nan")
                    ref = t.clone()
                    g.all_reduce(t, op=op)
                    dist.all_reduce(ref, op=torch_op)
                    torch.cuda.synchronize()
                    if not torch.equal(t.nan_to_num(-7.0), ref.nan_to_num(-7.0)):
                        failures.append(f"{op} {dtype} NaN on rank {nan_rank}: {t.tolist()}, torch {ref.tolist()}")
                    kept[f"{op} {dtype} {nan_rank}"] = bool(t[0].isnan())
        # the infinity norm of gradients (FSDP's and OSS's clip_grad_norm) keeps a NaN from any rank
        from fairscale_c.internal.params import reduce_norm_term

        for nan_rank in range(world):
            term = torch.tensor([math.nan if rank == nan_rank else 2.0 + rank], device="cuda")
            if not bool(reduce_norm_term(g, term, math.inf).isnan()):
                failures.append(f"inf norm with a NaN on rank {nan_rank} is not NaN")
    dist.destroy_process_group()
    return failures, kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_moves_int8_int16_bool_and_max_min_match_torch_with_a_nan():
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    results = run_ranks(_nccl_dtypes_and_nan_job, 2, env={**FAST, **nccl_env}, timeout=240)
    print("NaN kept:", results[0][1])
    assert [failures for failures, _ in results] == [[], []], results
    assert results[0][1] == results[1][1]  # every rank holds the same result
