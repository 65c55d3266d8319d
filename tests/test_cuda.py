"""CUDA kernels against their CPU references and torch, and the NCCL backend across 2 ranks.

Tests marked ``gpu`` skip cleanly without a CUDA device; the others check what must hold on
every machine (discovery never raises, arguments are checked before any CUDA call).
"""

import importlib.util
import math
import os
import time
import traceback
from pathlib import Path

import pytest
import torch

from fairscale_c import _C
from test_kernels_cpu import _specials

ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")


def _load_build_cuda():
    spec = importlib.util.spec_from_file_location("build_cuda", ROOT / "tools" / "build_cuda.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- every machine -----------------------------------------------------------------------------


def test_gpu_info_reports_without_raising():
    info = _C.gpu_info()
    for key in ("driver_found", "runtime_found", "kernels_built"):
        assert isinstance(info[key], bool)
    for key in ("driver_version", "runtime_version", "device_count", "nccl_version"):
        assert isinstance(info[key], int)
    if info["error"] is None:
        assert info["driver_found"] and info["driver_version"] > 0 and info["device_count"] >= 1
    else:
        assert isinstance(info["error"], str) and info["device_count"] == 0
    if info["runtime_found"]:
        assert info["runtime_version"] > 0 and info["runtime_path"]
    if HAS_CUDA:
        assert info["device_count"] == torch.cuda.device_count()


def test_kernels_built_when_nvcc_present():
    if os.environ.get("FAIRSCALE_C_CUDA") == "0" or _load_build_cuda().find_nvcc() is None:
        pytest.skip("nvcc not found, so the build has no CUDA kernels")
    assert _C.gpu_info()["kernels_built"]


def test_launchers_check_arguments_before_touching_cuda():
    with pytest.raises(ValueError, match="src must be a CUDA tensor"):
        _C.cuda_cast(torch.zeros(4, dtype=torch.float16), torch.zeros(4), 0)
    with pytest.raises(ValueError, match="buf must be a CUDA tensor"):
        _C.cuda_unscale_inf_check(torch.zeros(4), 1.0, torch.zeros(1), 0)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        _C.cuda_sq_norm(torch.zeros(1), torch.zeros(4), torch.zeros(8), 0)
    with pytest.raises(ValueError, match="param must be a CUDA tensor"):
        _C.cuda_adamw_step(*(torch.zeros(4) for _ in range(4)), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0)
    with pytest.raises(ValueError, match="stream"):
        _C.cuda_cast(torch.zeros(4, dtype=torch.float16), torch.zeros(4), -1)


def test_nccl_comm_rejects_a_malformed_unique_id():
    with pytest.raises(ValueError, match="unique_id"):
        _C.NcclComm(b"short", 0, 1, 0)


# ---- kernels (GPU) -----------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_cast_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    src = torch.cat([torch.randn(1 << 20, generator=g) * 1000, torch.randn(4099, generator=g) * 1e-6, _specials(dtype)])
    src = src.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    dst = torch.empty(src.shape, dtype=dtype, device="cuda")
    _C.cuda_cast(dst, src, side.cuda_stream)  # also exercises a non-default stream
    side.synchronize()
    assert torch.equal(dst.view(torch.int16), src.to(dtype).view(torch.int16))

    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).cuda().view(dtype)
    bits = bits[~torch.isnan(bits)]
    up = torch.empty(bits.shape, dtype=torch.float32, device="cuda")
    _C.cuda_cast(up, bits, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(up, bits.float())


@gpu
@needs_cuda
@pytest.mark.parametrize("consumer", ["current", "side"])
def test_cuda_import_orders_a_producer_still_running(consumer):
    """A tensor still being written on torch's current stream, taken by a kernel on that stream
    (imported without synchronising: the same stream orders it) or on another one (the import
    makes that stream wait for the producer): either way the kernel sees the written values."""
    n = 1 << 24
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # tens of milliseconds of work ahead of the producer
    src = torch.full((n,), 3.0, device="cuda").mul_(2)
    dst = torch.zeros(n, dtype=torch.float16, device="cuda")
    stream = torch.cuda.current_stream() if consumer == "current" else side
    _C.cuda_cast(dst, src, stream.cuda_stream)
    stream.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(dst, torch.full((n,), 6.0, dtype=torch.float16, device="cuda"))


@gpu
@needs_cuda
def test_cuda_cast_rejects_unsupported_pairs():
    a = torch.zeros(8, device="cuda")
    with pytest.raises(TypeError, match="float32 and float16/bfloat16"):
        _C.cuda_cast(a, torch.zeros(8, device="cuda"), 0)
    with pytest.raises(ValueError, match="dst has 4 elements"):
        _C.cuda_cast(torch.zeros(4, dtype=torch.float16, device="cuda"), a, 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_pack_blocks_matches_cpu_on_a_side_stream(dtype):
    world, sizes = 4, [4 * 1000, 0, 4, 4 * 12345]
    srcs = [torch.randn(n).to(dtype) for n in sizes]
    ref = torch.empty(sum(sizes), dtype=dtype)
    _C.pack_blocks(ref, srcs, world)
    side = torch.cuda.Stream()
    cuda_srcs = [s.cuda() for s in srcs]  # written on the current stream: the import orders `side` after it
    out = torch.full((sum(sizes),), float("nan"), dtype=dtype, device="cuda")
    _C.pack_blocks(out, cuda_srcs, world, side.cuda_stream)
    side.synchronize()
    assert torch.equal(out.cpu(), ref)
    with pytest.raises(ValueError, match=r"srcs\[0\] must be a contiguous CUDA tensor"):
        _C.pack_blocks(out, srcs, world, 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 1000, (1 << 22) + 3])
def test_cuda_unscale_matches_cpu_reference(dtype, n):
    g = torch.Generator().manual_seed(n)
    host = (torch.randn(n, generator=g) * 512).to(dtype)
    for poison in (None, float("inf"), float("nan")):
        if poison is not None:
            host[n // 2] = poison
        ref, ref_flag = host.clone(), torch.zeros(1)
        _C.cpu_unscale_inf_check(ref, 1 / 64, ref_flag)
        dev, dev_flag = host.cuda(), torch.zeros(1, device="cuda")
        _C.cuda_unscale_inf_check(dev, 1 / 64, dev_flag, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        torch.testing.assert_close(dev.cpu(), ref, rtol=0, atol=0, equal_nan=True)
        assert dev_flag.item() == ref_flag.item() == (0.0 if poison is None else 1.0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 1000, (1 << 22) + 5])
def test_cuda_norm_matches_cpu_reference(dtype, n):
    g = torch.Generator().manual_seed(n)
    host = (torch.randn(n, generator=g) * 3).to(dtype)
    x = host.cuda()
    out = torch.empty(1, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for ws_size in (1, 7, 1024, 4096):
        ws = torch.empty(ws_size, device="cuda")
        _C.cuda_sq_norm(out, x, ws, stream)
        expected = _C.cpu_sq_norm(host)
        # float32 tree accumulation: error grows with the value, not with n
        assert out.item() == pytest.approx(expected, rel=2e-5, abs=1e-30)
        _C.cuda_sq_norm(out, x, ws, stream, absmax=True)
        assert out.item() == _C.cpu_sq_norm(host, absmax=True)
    # deterministic: same workspace, same bits
    ws = torch.empty(1024, device="cuda")
    a, b = torch.empty(1, device="cuda"), torch.empty(1, device="cuda")
    _C.cuda_sq_norm(a, x, ws, stream)
    _C.cuda_sq_norm(b, x, ws, stream)
    assert torch.equal(a, b)


@gpu
@needs_cuda
def test_cuda_norm_propagates_non_finite():
    x = torch.ones(100000, device="cuda")
    x[77777] = float("nan")
    out, ws = torch.empty(1, device="cuda"), torch.empty(256, device="cuda")
    for absmax in (False, True):
        _C.cuda_sq_norm(out, x, ws, 0, absmax=absmax)
        assert math.isnan(out.item())
    x[77777] = float("inf")
    _C.cuda_sq_norm(out, x, ws, 0, absmax=True)
    assert out.item() == math.inf


@gpu
@needs_cuda
def test_cuda_adamw_is_bit_identical_to_cpu_reference_and_close_to_torch():
    g = torch.Generator().manual_seed(5)
    n = (1 << 20) + 17
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(5)]

    cp, cm, cv = p0.clone(), torch.zeros(n), torch.zeros(n)
    dp, dm, dv = p0.cuda(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for step, grad in enumerate(grads, start=1):
        args = (hp["lr"], hp["betas"][0], hp["betas"][1], hp["eps"], hp["weight_decay"], step)
        _C.cpu_adamw_step(cp, grad, cm, cv, *args)
        _C.cuda_adamw_step(dp, grad.cuda(), dm, dv, *args, stream)
    torch.cuda.synchronize()
    assert torch.equal(dp.cpu(), cp) and torch.equal(dm.cpu(), cm) and torch.equal(dv.cpu(), cv)

    ref = torch.nn.Parameter(p0.cuda())
    opt = torch.optim.AdamW([ref], foreach=False, **hp)
    for grad in grads:
        ref.grad = grad.cuda()
        opt.step()
    torch.testing.assert_close(dp, ref.detach(), rtol=1e-6, atol=1e-7)


# ---- NCCL across 2 ranks (GPU) -----------------------------------------------------------------


def _nccl_devices():
    """(device per rank, extra environment) for a 2-rank group on this machine, or skip."""
    if torch.cuda.device_count() >= 2:
        return [0, 1], {}
    from fairscale_c.distributed._nccl import _nccl_candidates

    try:
        version = _C.nccl_load(_nccl_candidates())
    except RuntimeError as e:
        pytest.skip(f"NCCL not loadable: {e}")
    if version >= 23000:
        # NCCL <= 2.29 refuses two ranks on one GPU; 2.30 allows it experimentally.
        return [0, 0], {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    pytest.skip(f"one GPU and NCCL {version} < 2.30: two ranks cannot share it")


def _make_exchange(rank, size, q):
    def exchange(data):
        if rank == 0:
            for _ in range(size - 1):
                q.put(data)
            return data
        return q.get(timeout=120)

    return exchange


def _expect(fn, exc, match):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{exc.__name__} without {match!r}: {e}"
    else:
        raise AssertionError(f"expected {exc.__name__} matching {match!r}")


def _check_collectives(be, rank, size, dev):
    cuda = torch.device("cuda", dev)
    n = 1000

    def data(r, dtype, numel=n):
        g = torch.Generator().manual_seed(100 + r)
        return (torch.randn(numel, generator=g) * 10).round().to(dtype)

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        everyone = torch.stack([data(r, dtype).double() for r in range(size)])
        ops = {"sum": everyone.sum(0), "max": everyone.max(0).values, "min": everyone.min(0).values}
        if dtype.is_floating_point:
            ops["avg"] = everyone.mean(0)
        for op, expected in ops.items():
            t = data(rank, dtype).to(cuda)
            be.all_reduce(t, op)
            be.wait()
            torch.testing.assert_close(t.double().cpu(), expected.to(dtype).double(), rtol=1e-2, atol=1e-2)

    # all_gather, out of place and in place
    inp = data(rank, torch.float32).to(cuda)
    out = torch.empty(size * n, device=cuda)
    be.all_gather(out, inp)
    full = torch.cat([data(r, torch.float32) for r in range(size)])
    be.wait()
    assert torch.equal(out.cpu(), full)
    out2 = torch.zeros(size * n, device=cuda)
    out2[rank * n : (rank + 1) * n] = inp
    be.all_gather(out2, out2[rank * n : (rank + 1) * n])
    be.wait()
    assert torch.equal(out2.cpu(), full)

    # reduce_scatter
    big = [data(r, torch.float32, size * n) for r in range(size)]
    shard = torch.empty(n, device=cuda)
    be.reduce_scatter(shard, big[rank].to(cuda), "sum")
    be.wait()
    assert torch.equal(shard.cpu(), torch.stack(big).sum(0)[rank * n : (rank + 1) * n])

    # broadcast and reduce
    t = data(rank, torch.float32).to(cuda)
    be.broadcast(t, 1)
    be.wait()
    assert torch.equal(t.cpu(), data(1, torch.float32))
    t = data(rank, torch.float32).to(cuda)
    be.reduce(t, "sum", 0)
    be.wait()
    summed = torch.stack([data(r, torch.float32) for r in range(size)]).sum(0)
    assert torch.equal(t.cpu(), summed if rank == 0 else data(rank, torch.float32))

    # send / recv both ways, on a side stream
    side = torch.cuda.Stream(device=cuda)
    side.wait_stream(torch.cuda.current_stream(cuda))
    buf = data(rank, torch.float32).to(cuda)
    for sender in (0, 1):
        if rank == sender:
            be.send(buf, 1 - sender, stream=side)
        else:
            got = torch.empty(n, device=cuda)
            be.recv(got, sender, stream=side)
            be.wait(stream=side)
            assert torch.equal(got.cpu(), data(sender, torch.float32))
    be.wait(stream=side)
    be.barrier()

    # one NCCL group: collectives together, and a send/recv exchange in both directions at once
    # (ungrouped, two blocking sends first would wait on each other)
    g_out = torch.empty(size * n, device=cuda)
    rs_out = torch.empty(n, device=cuda)
    ar = data(rank, torch.float32).to(cuda)
    bc = data(rank, torch.float32).to(cuda)
    got = torch.empty(n, device=cuda)
    peer = 1 - rank
    be.batch(
        [
            ("all_gather", g_out, inp),
            ("reduce_scatter", rs_out, big[rank].to(cuda), "sum"),
            ("all_reduce", ar, "max"),
            ("broadcast", bc, 0),
            ("send", data(rank, torch.float32).to(cuda), peer),
            ("recv", got, peer),
        ]
    )
    be.wait()
    assert torch.equal(g_out.cpu(), full)
    assert torch.equal(rs_out.cpu(), torch.stack(big).sum(0)[rank * n : (rank + 1) * n])
    assert torch.equal(ar.cpu(), torch.stack([data(r, torch.float32) for r in range(size)]).max(0).values)
    assert torch.equal(bc.cpu(), data(0, torch.float32))
    assert torch.equal(got.cpu(), data(peer, torch.float32))
    _expect(lambda: be.batch([]), ValueError, "operations")  # as Group.batch: an empty batch is a mistake
    _expect(lambda: be.batch([("all_reduce", ar, "sum"), ("all_gather", ar, ar)]), ValueError, "batch operation 1")
    _expect(lambda: be.batch([("gather", ar)]), ValueError, "all_gather, reduce_scatter")
    _expect(lambda: be.batch([("all_reduce", ar)]), TypeError, "takes 2 values")

    # bad arguments raise before anything is enqueued, and the communicator stays usable
    _expect(lambda: be.all_gather(torch.empty(n, device=cuda), inp), ValueError, "output")
    _expect(lambda: be.reduce_scatter(torch.empty(n + 1, device=cuda), big[rank].to(cuda), "sum"), ValueError, "input")
    _expect(lambda: be.all_reduce(torch.ones(4, dtype=torch.int64, device=cuda), "avg"), ValueError, "avg")
    _expect(lambda: be.all_reduce(torch.ones(4), "sum"), ValueError, "tensor")
    _expect(lambda: be.all_reduce(torch.ones(4, device=cuda), "mean"), ValueError, "mean")
    _expect(lambda: be.send(torch.ones(4, device=cuda), rank), ValueError, "dst")
    t = torch.ones(8, device=cuda)
    be.all_reduce(t, "sum")
    be.wait()
    assert t.cpu().tolist() == [float(size)] * 8


def _nccl_worker(rank, size, devices, env, q, results, scenario):
    os.environ.update(env)
    try:
        from fairscale_c import DistributedError
        from fairscale_c.distributed._nccl import NcclBackend

        dev = devices[rank]
        torch.cuda.set_device(dev)
        if scenario == "absent_at_init":  # rank 1 never joins: rank 0's init must give up, not hang
            if rank == 0:
                start = time.monotonic()
                join = lambda: NcclBackend(rank, size, _make_exchange(rank, size, q), device=dev, timeout=5)  # noqa: E731
                _expect(join, DistributedError, "init")
                assert time.monotonic() - start < 60, f"init gave up after {time.monotonic() - start:.0f} s"
            results.put((rank, "ok"))
            return
        timeout = 5 if scenario in ("watchdog", "unmatched_send") else 120
        be = NcclBackend(rank, size, _make_exchange(rank, size, q), device=dev, timeout=timeout)
        assert be.rank == rank and be.size == size and be.version > 0
        if scenario == "collectives":
            _check_collectives(be, rank, size, dev)
            be.destroy()
            be.destroy()  # idempotent
        elif scenario == "watchdog":
            # rank 1 dies mid-training; rank 0 only enqueues (as FSDP does) and then blocks in a
            # host synchronisation, which must come back once the watchdog aborts the
            # communicator (an NCCL error, or the 5 s timeout), not hang
            be.barrier()
            if rank == 1:
                results.put((rank, "ok"))
                results.close()
                results.join_thread()
                os._exit(0)
            t = torch.ones(1 << 20, device=torch.device("cuda", dev))
            time.sleep(1.0)
            start = time.monotonic()
            for _ in range(3):
                be.all_reduce(t, "sum")
            torch.cuda.synchronize()
            assert time.monotonic() - start < 60, f"synchronize came back after {time.monotonic() - start:.0f} s"
            _expect(lambda: be.all_reduce(t, "sum"), DistributedError, "aborted")
        elif scenario == "unmatched_send":
            # rank 0's first send to rank 1, which never receives: NCCL's enqueue may wait for the
            # connection (blocking communicators: the submitter's deadline ends it) or return and
            # leave the kernel waiting (the host wait's timeout ends it); either way an exception
            # within the timeout, then a dead communicator
            be.barrier()
            if rank == 0:
                t = torch.ones(1 << 20, device=torch.device("cuda", dev))
                start = time.monotonic()

                def send_and_wait():
                    be.send(t, 1)
                    be.wait(timeout=5)

                _expect(send_and_wait, DistributedError, "")
                assert time.monotonic() - start < 30, f"gave up after {time.monotonic() - start:.0f} s"
                _expect(lambda: be.all_reduce(t, "sum"), DistributedError, "aborted")
                q.put("rank0 done")
            else:
                assert q.get(timeout=120) == "rank0 done"
                be.abort()
        else:  # "dead_peer": rank 1 never joins the all_reduce; rank 0 must time out, not hang
            be.barrier()
            if rank == 0:
                t = torch.ones(4, device=torch.device("cuda", dev))
                be.all_reduce(t, "sum")
                start = time.monotonic()
                _expect(lambda: be.wait(timeout=5), DistributedError, "did not complete within")
                assert time.monotonic() - start < 60
                _expect(lambda: be.all_reduce(t, "sum"), DistributedError, "aborted")
                q.put("rank0 done")
            else:
                assert q.get(timeout=120) == "rank0 done"
                be.abort()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _run_ranks(scenario, blocking="1"):
    devices, env = _nccl_devices()
    env = dict(env, FAIRSCALE_C_NCCL_BLOCKING=blocking)
    ctx = torch.multiprocessing.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_nccl_worker, args=(r, 2, devices, env, q, results, scenario)) for r in range(2)]
    for p in procs:
        p.start()
    outcome = {}
    try:
        for _ in procs:
            rank, msg = results.get(timeout=300)
            outcome[rank] = msg
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert outcome == {0: "ok", 1: "ok"}, "\n".join(f"rank {r}:\n{m}" for r, m in sorted(outcome.items()))


@gpu
@needs_cuda
@pytest.mark.parametrize("blocking", ["0", "1"], ids=["non_blocking", "blocking"])
def test_nccl_two_rank_collectives(blocking):
    _run_ranks("collectives", blocking)


@gpu
@needs_cuda
@pytest.mark.parametrize("blocking", ["0", "1"], ids=["non_blocking", "blocking"])
def test_nccl_init_gives_up_when_a_peer_never_joins(blocking):
    """Both communicator modes bound the init by the timeout (a blocking init runs on a thread of
    its own that the caller stops waiting for)."""
    _run_ranks("absent_at_init", blocking)


@gpu
@needs_cuda
def test_nccl_dead_peer_times_out_and_aborts():
    _run_ranks("dead_peer")


@gpu
@needs_cuda
def test_nccl_watchdog_unblocks_a_survivor_that_never_waits():
    _run_ranks("watchdog")


@gpu
@needs_cuda
@pytest.mark.parametrize("blocking", ["0", "1"], ids=["non_blocking", "blocking"])
def test_nccl_send_nobody_receives_raises_within_the_timeout(blocking):
    """A first send that its peer never receives: a blocking communicator's enqueue may wait
    inside NCCL for the connection, which the submitter's deadline bounds."""
    _run_ranks("unmatched_send", blocking)
