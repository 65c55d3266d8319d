"""fairscale_c.nn.pipe.AsyncPipe (FairScale's multi-process pipe, one partition per rank) against
plain torch: every rank holds one partition of a model and calls the pipe with the same batch;
after two SGD steps each rank's partition equals the same layers of one nn.Sequential trained on
the whole batch, for chunks 1, 2, 4 and an uneven last micro-batch and every checkpoint mode, at
2 and 3 stages; tuple and integer activations between stages; in-place ops at a partition's
start; eval mode; LazyModule lists realised only where kept; a rank beyond the partitions; a dead
stage; bad input."""

import itertools
import os
import time
import warnings

import pytest
import torch
from torch import nn

from dist_utils import OneRankGroup, clean_dev_shm, join_gloo, run_ranks  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_dev_shm")


class Split(nn.Module):
    """Returns (x, row lengths as int64): a tuple with a non-differentiable tensor crosses stages."""

    def forward(self, x):
        return x, torch.full((x.shape[0],), 3, dtype=torch.int64, device=x.device)


class Join(nn.Module):
    def forward(self, xs):
        x, lengths = xs
        return x * lengths.unsqueeze(1).to(x.dtype)


class Mask(nn.Module):
    def forward(self, x):
        return x * 2, x > 0


class Masked(nn.Module):
    def forward(self, xs):
        y, keep = xs
        return torch.where(keep, y, torch.zeros_like(y))


def _model(width=6):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, width), nn.Tanh(), Split(), Join(), nn.ReLU(inplace=True), nn.Linear(width, width),
        nn.Dropout(0.0), nn.Linear(width, 2),
    ).double()  # fmt: skip


# 2 stages: stage 1 starts with ReLU(inplace=True), or with Join (a float and an int64 tensor cross);
# 3 stages: the middle one holds no parameters, the last starts with ReLU(inplace=True)
BALANCES = {2: [[4, 4], [3, 5]], 3: [[2, 3, 3]]}


def _data(batch):
    g = torch.Generator().manual_seed(5)
    return torch.randn(batch, 4, generator=g, dtype=torch.float64)


def _reference(steps, batch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _data(batch)
    outs = []
    for _ in range(steps):
        out = model(x)
        outs.append(out.detach())
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, outs


def _job(rank, world, device="cpu"):
    import torch.distributed as dist

    from fairscale_c.nn.pipe import AsyncPipe

    join_gloo(rank, world, device)
    failures = []
    try:
        # the last: a batch of 2 in 4 chunks gives 2 micro-batches, as FairScale's split does
        cases = [(1, "never", 8), (2, "except_last", 8), (4, "always", 8), (3, "except_last", 10), (4, "never", 2)]
        for balance, (chunks, checkpoint, batch) in itertools.product(BALANCES[world], cases):
            start = sum(balance[:rank])
            ref, ref_outs = _reference(2, batch)
            pipe = AsyncPipe(_model(), balance, group=dist.group.WORLD, chunks=chunks, checkpoint=checkpoint)
            pipe.to(device)
            params = list(pipe.parameters())  # the middle stage of 3 holds no parameters
            opt = torch.optim.SGD(params, lr=0.1) if params else None
            x = _data(batch).to(device)
            for step in range(2):
                out = pipe(x)
                if pipe.final_stage:
                    if not torch.allclose(out.cpu(), ref_outs[step], rtol=1e-12, atol=1e-12):
                        failures.append(f"chunks {chunks} {checkpoint}: output of step {step} differs")
                    out.pow(2).mean().backward()
                else:
                    assert isinstance(out, list)
                    pipe.back_helper(out)
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
            mine = dict(pipe.named_parameters())
            for name, p in ref.named_parameters():
                index, rest = name.split(".", 1)
                if start <= int(index) < start + balance[rank]:
                    got = mine.pop(f"0.{index}.{rest}")
                    if not torch.allclose(got.cpu(), p.detach(), rtol=1e-12, atol=1e-12):
                        failures.append(f"{balance} chunks {chunks} {checkpoint} batch {batch}: {name} differs")
            if mine:
                failures.append(f"unexpected parameters {sorted(mine)}")
        # a boolean tensor crosses (as bytes: the engine's point-to-point takes no bool); at world 3
        # rank 2 holds no partition and gets its input back
        fork = nn.Sequential(Mask(), Masked())
        x = _data(6).to(device).requires_grad_()
        pipe = AsyncPipe(fork, [1, 1], group=dist.group.WORLD, chunks=2, checkpoint="always")
        out = pipe(x)
        if pipe.final_stage and not torch.equal(out.cpu(), torch.where(x.detach() > 0, x.detach() * 2, 0).cpu()):
            failures.append("a boolean mask did not cross intact")
        if pipe.final_stage:
            out.sum().backward()
        elif rank == 0 and not torch.equal(x.grad.cpu(), torch.where(x.detach() > 0, 2.0, 0.0).cpu().double()):
            failures.append("the gradient through the masked stage differs")
        # eval mode: the last stage's output is the model's; no gradients travel
        pipe = AsyncPipe(_model(), BALANCES[world][-1], group=dist.group.WORLD, chunks=3).to(device).eval()
        out = pipe(_data(7).to(device))
        if pipe.final_stage and not torch.allclose(out.cpu(), _model()(_data(7)), rtol=1e-12, atol=1e-12):
            failures.append("eval output differs")
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_training_equals_plain_torch(world):
    assert run_ranks(_job, world, timeout=300) == [[]] * world


class _AddOne(nn.Module):
    def forward(self, x):
        return x.add_(1.0)


def _inplace_job(rank, world):
    """Each stage begins with an in-place op that is not idempotent, in every checkpoint mode and
    with 1 or 2 micro-batches (views of one batch on stage 0): the plain model's gradients."""
    import copy

    import torch.distributed as dist

    from fairscale_c.nn.pipe import AsyncPipe

    join_gloo(rank, world)
    failures = []
    try:
        for mode, chunks in itertools.product(["never", "except_last", "always"], [1, 2]):
            torch.manual_seed(0)
            model = nn.Sequential(_AddOne(), nn.Linear(3, 3), _AddOne(), nn.Linear(3, 3))
            ref = copy.deepcopy(model)
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
            pipe = AsyncPipe(model, [2, 2], group=dist.group.WORLD, chunks=chunks, checkpoint=mode)
            out = pipe(x.clone())
            if rank == 1:
                out.sum().backward()
            else:
                pipe.back_helper(out)
            ref(x.clone()).sum().backward()
            mine = [p for i, p in enumerate(ref.parameters()) if (i < 2) == (rank == 0)]
            if not all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(pipe.parameters(), mine)):
                failures.append(f"{mode}, {chunks} chunks: gradients differ on rank {rank}")
    finally:
        dist.destroy_process_group()
    return failures


def test_stages_beginning_with_inplace_ops():
    assert run_ranks(_inplace_job, 2, timeout=120, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [[], []]


def _lazy_job(rank, world):
    import torch.distributed as dist

    from fairscale_c.nn.pipe import AsyncPipe, LazyModule

    dist.init_process_group("gloo", rank=rank, world_size=world)
    built = []

    def layer(i):
        def make():
            built.append(i)
            torch.manual_seed(i)
            return nn.Linear(3, 3)

        return LazyModule(make)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = AsyncPipe([layer(i) for i in range(4)], [1, 3], group=dist.group.WORLD, chunks=2)
        x = torch.randn(4, 3)
        out = pipe(x)
        if rank == 1:
            out.sum().backward()
        if rank == 2:  # beyond the partitions: nothing held, the input comes back
            assert any("More ranks than partitions" in str(w.message) for w in caught)
            assert out is x and len(pipe) == 0 and list(pipe.parameters()) == []
        return sorted(built), len(pipe)
    finally:
        dist.destroy_process_group()


def test_lazy_modules_are_built_where_kept():
    assert run_ranks(_lazy_job, 3, timeout=120) == [([0], 1), ([1, 2, 3], 3), ([], 0)]


def _dead_stage_job(rank, world):
    import torch.distributed as dist

    import fairscale_c
    from fairscale_c.nn.pipe import AsyncPipe

    dist.init_process_group("gloo", rank=rank, world_size=world)
    pipe = AsyncPipe(_model(), BALANCES[2][0], group=dist.group.WORLD, chunks=2)
    x = _data(4)
    out = pipe(x)  # one whole step
    if rank == 1:
        out.sum().backward()
        pipe(x)  # the last stage's forward returns; it dies instead of running backward
        time.sleep(0.3)
        os._exit(1)
    start = time.perf_counter()
    try:
        pipe(x)
    except fairscale_c.DistributedError as exc:
        assert "rank 1" in str(exc), str(exc)
        return time.perf_counter() - start
    raise AssertionError("no DistributedError raised")


class _Raises(nn.Module):
    def forward(self, x):
        raise ArithmeticError("a partition raised")


def _raising_stage_job(rank, world):
    import torch.distributed as dist

    from fairscale_c.nn.pipe import AsyncPipe

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), _Raises())
    pipe = AsyncPipe(model, [2, 1], group=dist.group.WORLD, chunks=2)
    got = []
    for _ in range(2):  # stage 0 waits for gradients that stage 1 will never send
        start = time.perf_counter()
        try:
            pipe(_data(4).float())
            got.append(("nothing", "", 0.0))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            got.append((type(exc).__name__, str(exc), time.perf_counter() - start))
    return got


def test_a_stage_that_raises_makes_the_others_raise_at_once():
    (first0, again0), (first1, again1) = run_ranks(_raising_stage_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert first1[:2] == ("ArithmeticError", "a partition raised"), first1
    assert first0[0] == "DistributedError" and "rank 1 (pid" in first0[1] and "gave up" in first0[1], first0
    assert first0[2] < 20, f"{first0}: expected well before the 60 s timeout"
    assert again0[0] == again1[0] == "DistributedError" and "gave up" in again0[1] + again1[1], (again0, again1)


@pytest.mark.serial  # kills a rank; times how soon the peer knows
def test_dead_stage_is_reported():
    # rank 0 is inside its second forward waiting for gradients when rank 1 dies
    elapsed, _ = run_ranks(_dead_stage_job, 2, env={"FAIRSCALE_C_TIMEOUT": "30"}, may_die=[1])
    assert elapsed < 10, f"dead stage found after {elapsed:.1f} s; expected well before the 30 s timeout"


def test_one_stage_and_bad_arguments():
    from fairscale_c.nn.pipe import AsyncPipe

    g = OneRankGroup()
    ref, outs = _reference(1, 6)
    pipe = AsyncPipe(_model(), [8], group=g, chunks=3, checkpoint="always")
    assert pipe.final_stage and len(pipe) == 8 and isinstance(pipe[0], nn.Linear)
    out = pipe(_data(6))
    assert torch.allclose(out, outs[0], rtol=1e-12, atol=1e-12)
    out.pow(2).mean().backward()
    grads = [p.grad for p in pipe.parameters()]
    model = _model()
    model(_data(6)).pow(2).mean().backward()
    assert all(torch.allclose(a, b.grad, rtol=1e-12, atol=1e-12) for a, b in zip(grads, model.parameters()))
    with pytest.raises(ValueError, match="non-final"):
        pipe.back_helper(out)
    cases = [
        (dict(balance=[4, 3]), ValueError, "sum of balance"),
        (dict(balance=[8, 0]), ValueError, "positive"),
        (dict(balance=[4, 4]), IndexError, "too few ranks"),
        (dict(balance=[8], chunks=0), ValueError, "chunks"),
        (dict(balance=[8], checkpoint="sometimes"), ValueError, "checkpoint"),
    ]
    for kwargs, exc, words in cases:
        with pytest.raises(exc, match=words):
            AsyncPipe(_model(), group=g, **kwargs)
    with pytest.raises(TypeError, match="nn.Sequential"):
        AsyncPipe(nn.Linear(2, 2), [1], group=g)
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="duplicate"):
        AsyncPipe([layer, layer], [2], group=g)
    with pytest.raises(TypeError, match="Tensor"):
        pipe("not a tensor")

    class Words(nn.Module):
        def forward(self, x):
            return x, "hello"

    with pytest.raises(TypeError, match="partition's output"):
        AsyncPipe(nn.Sequential(Words()), [1], group=g)(torch.ones(2))


def test_deferred_batch_norm_commits_once_per_mini_batch():
    # 3 and 2 rows in chunks=4 make 3 and 2 micro-batches; each mini-batch still commits once
    from fairscale_c.nn.pipe import AsyncPipe

    ref = nn.BatchNorm1d(2)
    pipe = AsyncPipe(nn.Sequential(nn.BatchNorm1d(2)), [1], group=OneRankGroup(), chunks=4, deferred_batch_norm=True)
    torch.manual_seed(0)
    for step, rows in enumerate([3, 8, 2]):
        x = torch.randn(rows, 2, 5) + 10 * step
        ref(x)
        pipe(x).sum().backward()
        assert pipe[0].num_batches_tracked.item() == step + 1
        torch.testing.assert_close(pipe[0].running_mean, ref.running_mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pipe[0].running_var, ref.running_var, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_ranks_equals_plain_torch():
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    assert run_ranks(_job, 2, "cuda", env=nccl_env, timeout=300) == [[]] * 2


def _fairscale_job(rank, world):
    """FairScale's AsyncPipe (over RPC) and ours on the same model and batch: the same output on
    the last stage and the same gradients on every stage."""
    import torch.distributed as dist
    from fairscale.nn.pipe import AsyncPipe as Theirs

    from dist_utils import fairscale_pipeline_rpc
    from fairscale_c.nn.pipe import AsyncPipe as Ours

    join_gloo(rank, world)
    failures = []
    try:
        with fairscale_pipeline_rpc(rank, world) as workers:
            results = []
            for make in (
                lambda m: Theirs(m, [3, 5], worker_map=workers, chunks=3, checkpoint="except_last"),
                lambda m: Ours(m, [3, 5], group=dist.group.WORLD, chunks=3, checkpoint="except_last"),
            ):
                # stage 1 starts with Join: a (float, int64) tuple crosses (FairScale's AsyncPipe
                # refuses an in-place op at a stage's start, so not the balance the other tests use)
                pipe = make(_model())
                out = pipe(_data(9))
                if pipe.final_stage:
                    out.pow(2).mean().backward()
                grads = [p.grad.clone() for p in pipe.parameters()]
                results.append((out.detach() if pipe.final_stage else None, grads))
        (out_fs, grads_fs), (out_ours, grads_ours) = results
        if out_fs is not None and not torch.allclose(out_fs, out_ours, rtol=1e-12, atol=1e-12):
            failures.append("outputs differ")
        if len(grads_fs) != len(grads_ours) or not all(
            torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(grads_fs, grads_ours)
        ):
            failures.append("gradients differ")
    finally:
        dist.destroy_process_group()
    return failures


def test_equals_fairscales_async_pipe():
    fs = pytest.importorskip("fairscale.nn.pipe")
    if fs.__spec__.name.startswith("fairscale_c"):
        pytest.skip("fairscale is this package's alias here, not FairScale")
    assert run_ranks(_fairscale_job, 2, timeout=200) == [[]] * 2
