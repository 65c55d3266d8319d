"""fairscale_c.distributed.all_to_all_single / all_to_all at 2, 3 and 4 ranks on the shared-memory
engine: every rank's result against the blocks the other ranks built (each rank can build every
rank's input), equal and uneven splits (empty blocks too), rows of several elements, dtypes,
async; a group of one rank; bad input raising before anything is sent."""

import pytest
import torch

from dist_utils import clean_dev_shm, join_gloo, not_equal, rank_data, run_ranks  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_dev_shm")


def _splits(world, salt):
    """split_sizes[src][dst]: rows rank src sends to rank dst (some 0)."""
    return [[(src * 3 + dst * 5 + salt) % 4 for dst in range(world)] for src in range(world)]


def _input(rank, rows, row_shape, dtype, salt):
    n = rows * int(torch.tensor(row_shape).prod().item()) if row_shape else rows
    return rank_data(rank, n, dtype, salt).reshape(rows, *row_shape)


def _job(rank, world, device="cpu"):
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    join_gloo(rank, world, device)
    failures = []
    try:
        group = fdist.init_group()
        for salt, (dtype, row_shape) in enumerate(
            [(torch.float32, ()), (torch.int64, (3,)), (torch.bfloat16, (2, 5)), (torch.float64, (7,))]
        ):
            # equal split: `world` rows per peer, sync and async
            for async_op in (False, True):
                inp = _input(rank, 2 * world, row_shape, dtype, salt).to(device)
                out = torch.empty_like(inp)
                work = fdist.all_to_all_single(out, inp, async_op=async_op)
                if async_op:
                    work.wait()
                want = torch.cat(
                    [_input(src, 2 * world, row_shape, dtype, salt)[2 * rank : 2 * rank + 2] for src in range(world)]
                )
                if msg := not_equal(out.cpu(), want):
                    failures.append(f"equal split {dtype} async={async_op}: {msg}")
            # uneven split with empty blocks
            sizes = _splits(world, salt)
            send = sizes[rank]
            recv = [sizes[src][rank] for src in range(world)]
            inp = _input(rank, sum(send), row_shape, dtype, 100 + salt).to(device)
            out = torch.full((sum(recv), *row_shape), 7, dtype=dtype, device=device)
            group.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
            blocks = []
            for src in range(world):
                theirs = _input(src, sum(sizes[src]), row_shape, dtype, 100 + salt)
                start = sum(sizes[src][:rank])
                blocks.append(theirs[start : start + sizes[src][rank]])
            if msg := not_equal(out.cpu(), torch.cat(blocks)):
                failures.append(f"uneven split {dtype}: {msg}")
        # the list form, blocks of different sizes
        inputs = [rank_data(rank, 3 + dst, torch.float32, 7 + dst).to(device) for dst in range(world)]
        outputs = [torch.empty(3 + rank, device=device) for _ in range(world)]
        fdist.all_to_all(outputs, inputs, async_op=True).wait()
        for src in range(world):
            if msg := not_equal(outputs[src].cpu(), rank_data(src, 3 + rank, torch.float32, 7 + rank)):
                failures.append(f"all_to_all from {src}: {msg}")
        # bad input raises on every rank before anything moves; the group stays usable
        x = torch.zeros(2 * world, 3)
        bad = [
            (lambda: fdist.all_to_all_single(x, x), "output overlaps input"),
            (lambda: fdist.all_to_all_single(torch.zeros(world + 1), torch.zeros(world + 1)), "divide evenly"),
            (lambda: fdist.all_to_all_single(torch.zeros(4), torch.zeros(4), [4], None), "must hold"),
            (
                lambda: fdist.all_to_all_single(torch.zeros(world), torch.zeros(world), None, [1] * (world - 1) + [9]),
                "sums to",
            ),
            (lambda: fdist.all_to_all_single(torch.zeros(world, 2), torch.zeros(world, 3)), "a row of output"),
            (lambda: fdist.all_to_all_single(torch.zeros(world), torch.zeros(world, dtype=torch.int32)), "same dtype"),
            (lambda: fdist.all_to_all_single(torch.zeros(world), torch.zeros(2, world).t()[0]), "contiguous"),
            (lambda: fdist.all_to_all_single(torch.zeros(world), [0.0] * world), "torch.Tensor"),
            (lambda: fdist.all_to_all([torch.zeros(1)], [torch.zeros(1)] * world), "list of"),
            (lambda: fdist.all_to_all([x[i : i + 1] for i in range(world)], [x[0:1]] * world), "overlaps"),
        ]
        for call, words in bad:
            try:
                call()
                failures.append(f"no error for: {words}")
            except (ValueError, TypeError) as exc:
                if words not in str(exc):
                    failures.append(f"expected {words!r} in: {exc}")
        ok = torch.full((1,), float(rank))
        fdist.all_reduce(ok)
        if ok.item() != sum(range(world)):
            failures.append(f"all_reduce after the errors gave {ok.item()}")
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_to_all_matches_the_blocks_every_rank_sent(world):
    results = run_ranks(_job, world, timeout=240)
    assert results == [[]] * world


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_all_to_all_on_nccl():
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    results = run_ranks(_job, 2, "cuda", env=nccl_env, timeout=240)
    assert results == [[]] * 2


def test_all_to_all_on_a_group_of_one_rank_is_a_copy():
    from fairscale_c.distributed import LocalGroup

    group = LocalGroup()
    inp = torch.arange(6.0).reshape(3, 2)
    out = torch.empty_like(inp)
    group.all_to_all_single(out, inp)
    assert torch.equal(out, inp)
    outs = [torch.empty(4)]
    assert group.all_to_all(outs, [torch.ones(4)], async_op=True).wait()
    assert torch.equal(outs[0], torch.ones(4))
    with pytest.raises(ValueError, match="'input_split_sizes' sums to 2; expected dim 0 of the tensor \\(3\\)"):
        group.all_to_all_single(out, inp, None, [2])


def _disagreeing_job(rank, world):
    import torch.distributed as dist

    import fairscale_c.distributed as fdist
    from fairscale_c import DistributedError

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fdist.init_group()
        try:  # this rank's own block: two sizes in one call
            fdist.all_to_all_single(torch.empty(5), torch.ones(4), [2, 3] if rank else [3, 2], [2, 2])
            own = "no error"
        except ValueError as exc:
            own = str(exc)
        # rank 1 expects nothing from rank 0, which sends two elements
        recv = [0, 2] if rank == 1 else [2, 2]
        try:
            fdist.all_to_all_single(torch.empty(sum(recv)), torch.ones(4), recv, [2, 2])
            peer = "no error"
        except DistributedError as exc:
            peer = str(exc)
        return own, peer
    finally:
        dist.destroy_process_group()


def test_split_sizes_that_disagree_raise_instead_of_leaving_a_message_behind():
    (own0, peer0), (own1, peer1) = run_ranks(_disagreeing_job, 2, env={"FAIRSCALE_C_TIMEOUT": "20"}, timeout=120)
    for own in (own0, own1):
        assert "own block has 3 rows in output but 2 in input" in own
    assert peer0 == "no error"  # its message fitted in the channel
    assert "send/recv mismatch" in peer1 and "recv(count=0" in peer1 and "send(count=2" in peer1


def _issue_order_job(rank, world):
    """Rank 1's input arrives through an async recv that is still pending when its async
    all_to_all_single is issued: the op reads it in issue order, own block included."""
    import time

    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = fdist.init_group()
        inp = torch.zeros(4)
        if rank == 0:
            time.sleep(0.3)  # rank 1 issues both ops before this send
            group.send(torch.arange(10.0, 14.0), 1)
            inp = torch.arange(4.0)
        else:
            group.recv(inp, 0, async_op=True)
        out = torch.full((4,), -1.0)
        group.all_to_all_single(out, inp, async_op=True).wait()
        return out.tolist()
    finally:
        dist.destroy_process_group()


def test_all_to_all_reads_its_input_in_issue_order():
    out0, out1 = run_ranks(_issue_order_job, 2, timeout=120)
    assert out0 == [0.0, 1.0, 10.0, 11.0]
    assert out1 == [2.0, 3.0, 12.0, 13.0]  # the own block too is what the recv delivered


def _copy_job(rank, world):
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    try:
        group = fdist.init_group()
        src, dst = torch.arange(5.0) + rank, torch.zeros(5)
        got = torch.zeros(3)
        work = group.batch([("copy", dst, src), ("send", src[:3], 1 - rank), ("recv", got, 1 - rank)], async_op=True)
        work.wait()
        if dst.tolist() != src.tolist() or got.tolist() != (torch.arange(3.0) + 1 - rank).tolist():
            failures.append(f"copy {dst.tolist()} recv {got.tolist()}")
        bad = [
            ([("copy", torch.zeros(4), torch.zeros(5))], "copy: output has 4 elements but input has 5"),
            (
                [("copy", torch.zeros(5), torch.zeros(5, dtype=torch.int64))],
                "copy: output is float32 but input is int64",
            ),
            ([("copy", src[1:], src[:4])], "copy: output overlaps input"),
            ([("copy", torch.zeros(5))], "copy"),
        ]
        for ops, words in bad:
            try:
                group.batch(ops)
                failures.append(f"no error for {words}")
            except (ValueError, TypeError) as exc:
                if words not in str(exc):
                    failures.append(f"expected {words!r} in: {exc}")
        for splits in ([1, -1] if world == 2 else None, [True, False], "ab"):
            try:
                group.all_to_all_single(torch.zeros(world), torch.zeros(world), None, splits)
                failures.append(f"split sizes {splits!r} accepted")
            except ValueError as exc:
                if "'input_split_sizes' must hold" not in str(exc):
                    failures.append(f"split sizes {splits!r}: {exc}")
    finally:
        dist.destroy_process_group()
    return failures


def test_batch_copies_and_bad_split_sizes_are_refused():
    assert run_ranks(_copy_job, 2, timeout=120) == [[], []]
