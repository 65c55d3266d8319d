"""Message tags on point-to-point ops: Group.send / recv(tag=), P2POp(tag=) in Group.batch and
batch_isend_irecv, the module-level send / recv. On the shm engine messages between two ranks
arrive in the order they were sent and a recv must give the tag of the next message (as it must
its count and dtype): a different tag is a DistributedError naming both tags on both ranks. NCCL
has no tags, so CUDA tensors take tag 0 only. One spawned job runs every two-rank scenario."""

from __future__ import annotations

import time

import pytest
import torch

from dist_utils import free_port, orphaned_segments, run_ranks

TIMEOUT_S = 5.0
ENV = {"FAIRSCALE_C_TIMEOUT": str(TIMEOUT_S)}
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


@pytest.fixture(autouse=True)
def clean_dev_shm():
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


def _data(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _round_trips(rank: int, g) -> list:
    """Scenarios that succeed; each returns its name once checked (the other rank's data, seeded)."""
    import fairscale_c.distributed as fdist

    peer, done = 1 - rank, []
    assert_close = torch.testing.assert_close

    # sync send/recv, including the int32 extremes and negative tags; rank 0 sends first, then rank 1
    for tag in (7, -3, I32_MIN, I32_MAX):
        for sender in (0, 1):
            x = _data(1000 + tag % 97 + sender, 33)
            if rank == sender:
                g.send(x, peer, tag=tag)
            else:
                y = torch.zeros(33)
                g.recv(y, peer, tag=tag)
                assert_close(y, x, rtol=0, atol=0)
    done.append("sync")

    # several messages on one channel, each with its own tag, received in the order sent
    xs = [_data(2000 + i, 5 + i) for i in range(4)]
    if rank == 0:
        for i, x in enumerate(xs):
            g.send(x, 1, tag=100 + i)
    else:
        for i, x in enumerate(xs):
            y = torch.empty_like(x)
            g.recv(y, 0, tag=100 + i)
            assert_close(y, x, rtol=0, atol=0)
    done.append("in order")

    # a message of several chunks (the p2p chunk is 256 KiB at the default 1 MiB chunk)
    big = _data(3000, 300_000)
    if rank == 0:
        g.send(big, 1, tag=42)
    else:
        y = torch.empty_like(big)
        g.recv(y, 0, tag=42)
        assert_close(y, big, rtol=0, atol=0)
    done.append("multi-chunk")

    # async both ways, each rank posting its recv first (cannot deadlock), tags per direction
    mine, theirs = _data(4000 + rank, 17), _data(4000 + peer, 17)
    y = torch.empty(17)
    works = [g.recv(y, peer, async_op=True, tag=10 + peer), g.send(mine, peer, async_op=True, tag=10 + rank)]
    for w in works:
        w.wait(timeout=60)
    assert_close(y, theirs, rtol=0, atol=0)
    done.append("async")

    # batch of P2POps: two messages each way on the same pair, recvs listed first, plus a tuple with a tag
    a, b, c = (_data(5000 + 10 * rank + i, 9 + i) for i in range(3))
    ra, rb, rc = (torch.empty(9 + i) for i in range(3))
    g.batch(
        [
            fdist.P2POp("recv", ra, peer, tag=1),
            fdist.P2POp(fdist.recv, rb, peer, tag=2),
            ("recv", rc, peer, 3),
            fdist.P2POp("send", a, peer, tag=1),
            fdist.P2POp(torch.distributed.isend, b, peer, tag=2),
            ("send", c, peer, 3),
        ]
    )
    for got, i in ((ra, 0), (rb, 1), (rc, 2)):
        assert_close(got, _data(5000 + 10 * peer + i, 9 + i), rtol=0, atol=0)
    done.append("batch")

    # batch_isend_irecv with tags (torch's shape: a list of Works)
    out = torch.empty(6)
    works = fdist.batch_isend_irecv(
        [
            fdist.P2POp(torch.distributed.irecv, out, peer, tag=-(rank + 1)),
            fdist.P2POp(torch.distributed.isend, _data(6000 + rank, 6), peer, tag=-(peer + 1)),
        ],
        group=g,
    )
    for w in works:
        w.wait(timeout=60)
    assert_close(out, _data(6000 + peer, 6), rtol=0, atol=0)
    done.append("batch_isend_irecv")

    # module-level functions; and the default tag is tag 0 on both sides
    x = _data(7000, 11)
    if rank == 0:
        fdist.send(x, 1, group=g, tag=5)
        fdist.send(x, 1, group=g)
        g.send(x, 1, tag=0)
    else:
        for kw in ({"tag": 5}, {"tag": 0}, {}):
            y = torch.empty(11)
            fdist.recv(y, 0, group=g, **kw)
            assert_close(y, x, rtol=0, atol=0)
    done.append("module-level and default tag")
    return done


def _mismatches(rank: int) -> list:
    """Each case on a group of its own (a mismatch breaks the group): both ranks raise within the
    timeout, naming both tags. The send completes once its data is in the shared buffer, so the
    sender learns of the refusal at its next op (a barrier here)."""
    import fairscale_c
    import fairscale_c.distributed as fdist

    def sync(g, send_tag, recv_tag):
        if rank == 0:
            g.send(torch.ones(4), 1, **send_tag)
            g.barrier()
        else:
            g.recv(torch.empty(4), 0, **recv_tag)

    def batch(g, send_tag, recv_tag):
        if rank == 0:
            g.batch([fdist.P2POp("send", torch.ones(4), 1, **send_tag)])
            g.barrier()
        else:
            g.batch([fdist.P2POp("recv", torch.empty(4), 0, **recv_tag)])

    def asynchronous(g, send_tag, recv_tag):
        if rank == 0:
            g.send(torch.ones(4), 1, async_op=True, **send_tag).wait(timeout=60)
            g.barrier(async_op=True).wait(timeout=60)
        else:
            g.recv(torch.empty(4), 0, async_op=True, **recv_tag).wait(timeout=60)

    cases = [
        ("sync", sync, {"tag": 1}, {"tag": 2}, ("tag=1", "tag=2")),
        ("batch", batch, {"tag": 5}, {"tag": -6}, ("tag=5", "tag=-6")),
        ("async", asynchronous, {"tag": 8}, {"tag": 9}, ("tag=8", "tag=9")),
        ("default", sync, {}, {"tag": 3}, ("tag=0", "tag=3")),
    ]
    results = []
    for name, fn, send_tag, recv_tag, needles in cases:
        g = fdist.init_group(name=f"tags-mismatch-{name}")
        t0 = time.perf_counter()
        try:
            fn(g, send_tag, recv_tag)
        except fairscale_c.DistributedError as exc:
            msg = str(exc)
        else:
            raise AssertionError(f"{name}: rank {rank} raised nothing")
        elapsed = time.perf_counter() - t0
        g.destroy()
        missing = [n for n in (*needles, "send/recv mismatch", f"'tags-mismatch-{name}'") if n not in msg]
        assert not missing, f"{name}: {missing} not in: {msg}"
        results.append((name, msg, elapsed))
    return results


def _job(rank: int, world: int, torch_port: int) -> dict:
    import fairscale_c.distributed as fdist

    g = fdist.init_group(name="tags")
    done = _round_trips(rank, g)
    g.destroy()
    mismatches = _mismatches(rank)
    # the torch.distributed path of a group spanning hosts passes tags to torch (gloo)
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world)
    os.environ["FAIRSCALE_C_HOSTNAME"] = f"host{rank}"
    t = fdist.init_group(name="tags-torch")
    assert "torch" in repr(t), repr(t)
    x, y = _data(8000 + rank, 7), torch.empty(7)
    if rank == 0:
        t.send(x, 1, tag=12)
    else:
        t.recv(y, 0, tag=12)
        torch.testing.assert_close(y, _data(8000, 7), rtol=0, atol=0)
    t.batch([fdist.P2POp("recv", y, 1 - rank, tag=30 + rank), fdist.P2POp("send", x, 1 - rank, tag=31 - rank)])
    torch.testing.assert_close(y, _data(8000 + 1 - rank, 7), rtol=0, atol=0)
    t.destroy()
    dist.destroy_process_group()
    return {"done": done, "mismatches": mismatches}


@pytest.mark.serial  # times errors against a 5 s engine timeout
def test_tags_two_ranks():
    results = run_ranks(_job, 2, free_port(), env=ENV, timeout=120)
    for rank, r in enumerate(results):
        assert r["done"] == [
            "sync",
            "in order",
            "multi-chunk",
            "async",
            "batch",
            "batch_isend_irecv",
            "module-level and default tag",
        ]
        assert [m[0] for m in r["mismatches"]] == ["sync", "batch", "async", "default"]
        for name, msg, elapsed in r["mismatches"]:
            assert elapsed < TIMEOUT_S, f"rank {rank} {name}: {elapsed:.2f} s: {msg}"
            if rank == 0:
                assert "refused a message rank 0 sent it" in msg, msg
            assert "in the order they were sent" in msg, msg


# ---------------------------------------------------------------- argument rules (one rank, in process)
BAD_TAGS = [
    (1.5, TypeError, "must be an int, got float"),
    ("3", TypeError, "must be an int, got str"),
    (None, TypeError, "must be an int, got NoneType"),
    (I32_MAX + 1, ValueError, "must fit a 32-bit signed int"),
    (I32_MIN - 1, ValueError, "must fit a 32-bit signed int"),
    (2**70, ValueError, "must fit a 32-bit signed int"),
]


@pytest.mark.parametrize("tag, exc, needle", BAD_TAGS)
def test_bad_tags_are_refused_before_anything_is_sent(solo, tag, exc, needle):
    import fairscale_c.distributed as fdist

    x = torch.ones(3)
    # the Python layer (what every backend sees) ...
    with pytest.raises(exc, match=rf"send: argument 'tag' {needle}"):
        solo.send(x, 0, tag=tag)
    with pytest.raises(exc, match=rf"recv: argument 'tag' {needle}"):
        solo.recv(x, 0, tag=tag)
    with pytest.raises(exc, match=rf"P2POp: argument 'tag' {needle}"):
        fdist.P2POp("send", x, 0, tag=tag)
    with pytest.raises(exc, match=rf"send: argument 'tag' {needle}"):
        fdist.send(x, 0, group=solo, tag=tag)
    # ... and the binding, for batches of tuples and direct calls
    with pytest.raises(exc, match=rf"item 1 \(recv\): argument 'tag' {needle}"):
        solo.batch([("all_reduce", x, "sum"), ("recv", x, 0, tag)])
    with pytest.raises(exc, match=rf"send: argument 'tag' {needle}"):
        solo._shm.send(x, 0, tag=tag)


def test_tag_rules(solo):
    import fairscale_c.distributed as fdist

    x = torch.ones(3)
    # a good tag does not hide the other argument errors (a one-rank group has no peer)
    with pytest.raises(ValueError, match=r"send: dst=0 is not a valid group rank"):
        solo.send(x, 0, tag=I32_MAX)
    with pytest.raises(ValueError, match=r"batch operation 0: recv: src=0 is not a valid group rank"):
        solo.batch([fdist.P2POp("recv", x, 0, tag=I32_MIN), ("all_reduce", x, "sum")])
    # tuples: a tag only after (tensor, peer) of a send / recv
    with pytest.raises(TypeError, match=r"item 0 \(send\) takes 2 or 3 values after the name \(tensor, peer\["):
        solo.batch([("send", x, 1, 2, 3)])
    with pytest.raises(TypeError, match=r"item 0 \(all_reduce\) takes 2 values after the name, got 3"):
        solo.batch([("all_reduce", x, "sum", 4)])
    # P2POp keeps its tag; an integer-like tag (operator.index) is accepted as that int
    op = fdist.P2POp("send", x, 1, tag=torch.tensor(9).numpy()[()])
    assert op.tag == 9 and type(op.tag) is int and op.as_tuple()[3] == 9
    assert fdist.P2POp("recv", x, 1).tag == 0
    # a P2POp may name its group, as torch's does; a batch on another group refuses it
    assert fdist.P2POp("send", x, 1, group=solo).group is solo
    with pytest.raises(ValueError, match="every P2POp of a batch must name its group or none"):
        solo.batch([fdist.P2POp("send", x, 0, group=object())])
    # a group of one (LocalGroup) checks the tag before saying it has no peer
    local = fdist.LocalGroup()
    with pytest.raises(TypeError, match="send: argument 'tag' must be an int"):
        local.send(x, 0, tag=0.0)
    with pytest.raises(ValueError, match="no peer"):
        local.recv(x, 0, tag=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_refuses_tags(solo):
    """NCCL has no message tags: a nonzero tag on a CUDA tensor is a ValueError before anything is
    enqueued (tag 0 then fails only because a group of one has no peer)."""
    import fairscale_c.distributed as fdist

    x = torch.ones(3, device="cuda")
    for call in (
        lambda: solo.send(x, 0, tag=3),
        lambda: solo.recv(x, 0, tag=3),
    ):
        with pytest.raises(ValueError, match=r"tag=3 is not supported for CUDA tensors \(NCCL has no message tags\)"):
            call()
    with pytest.raises(ValueError, match=r"batch operation 0: send: tag=3 is not supported for CUDA tensors"):
        solo.batch([fdist.P2POp("send", x, 0, tag=3)])
    with pytest.raises(ValueError, match=r"send: dst=0 is not a valid group rank"):
        solo.send(x, 0, tag=0)
