"""fairscale_c.nn.pipe.PipeRPCWrapper (FairScale's AsyncPipe driven from rank 0 over torch RPC) on
CPU ranks, against one nn.Sequential trained on the same batches in one process: outputs, and
every stage's parameters after two optimizer steps run through foreach_worker (which also checks
them on the stages), for 2 and 3 stages, the pipeline group and the default group, several chunk
counts and checkpoint modes, a tuple output, eval mode and no_grad; threads and stages
released with the wrapper; an error in a stage or a callback raised on rank 0 at once; bad input.
GPU-marked: the training cases on 2 CUDA ranks."""

import gc
import time

import pytest
import torch
from torch import nn

from dist_utils import clean_dev_shm, join_gloo, rpc_workers, run_ranks  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_dev_shm")
TOL = dict(rtol=1e-12, atol=1e-12)


class Pair(nn.Module):
    """Ends a model with a tuple: (x, x.sum(1))."""

    def forward(self, x):
        return x, x.sum(1)


class Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom in stage 1")


def _model(pair=False):
    torch.manual_seed(0)
    layers = [nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 3), nn.Sigmoid()]
    return nn.Sequential(*layers, *([Pair()] if pair else [])).double()


def _batch(seed):
    return torch.randn(10, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _loss(out):
    if isinstance(out, tuple):
        return out[0].pow(2).mean() + out[1].mean()
    return out.pow(2).mean()


def _register_optimizer(ctx, model):
    params = list(model.parameters())
    model.optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9) if params else None


def _step_optimizer(ctx, model):
    if model.optimizer is not None:
        model.optimizer.step()
        model.optimizer.zero_grad()


def _check_parameters(expected, model):
    """Raises unless this stage's layers equal ``expected`` ({layer index: [host tensors]})."""
    for name, layer in model.partition.named_children():
        for got, want in zip(layer.parameters(), expected.get(int(name), [])):
            if not torch.allclose(got.cpu(), want, **TOL):
                raise AssertionError(f"layer {name} differs from the reference")


def _fail(ctx, model):
    raise KeyError(f"callback failed on stage {model.stage}")


def _train(rank, world, failures, balance, chunks, checkpoint, group, worker_map, pair=False, device="cpu"):
    import torch.distributed as dist

    from fairscale_c.nn.pipe import PipeRPCWrapper

    what = f"{balance} chunks {chunks} {checkpoint} {'world' if group else 'pipeline'} group"
    pipe = PipeRPCWrapper(
        _model(pair), balance, chunks=chunks, checkpoint=checkpoint, worker_map=worker_map,
        **({"group": dist.group.WORLD} if group else {}), **({"input_device": device} if device != "cpu" else {}),
    )  # fmt: skip
    ref = _model(pair).to(device)
    pipe.foreach_worker(_register_optimizer, include_self=True)
    _register_optimizer(None, ref)
    for step in range(2):
        x = _batch(step).to(device)
        out, want = pipe(x), ref(x)
        outs, wants = (out, want) if pair else ((out,), (want,))
        if not all(torch.allclose(a, b, **TOL) for a, b in zip(outs, wants)):
            failures.append(f"{what}: output of step {step} differs")
        _loss(out).backward()
        _loss(want).backward()
        pipe.foreach_worker(_step_optimizer, include_self=True)
        _step_optimizer(None, ref)
    expected = {i: [p.detach().cpu() for p in layer.parameters()] for i, layer in enumerate(ref)}
    pipe.foreach_worker(_check_parameters, expected, include_self=True)
    # eval mode, and training mode under no_grad: outputs only, nothing waits for a backward
    x = _batch(7).to(device)
    for mode in ("eval", "no_grad"):
        if mode == "eval":
            pipe.eval()
            out = pipe(x)
        else:
            pipe.train()
            with torch.no_grad():
                out = pipe(x)
        with torch.no_grad():
            want = ref(x)
        outs, wants = (out, want) if pair else ((out,), (want,))
        if not all(torch.allclose(a, b, **TOL) for a, b in zip(outs, wants)):
            failures.append(f"{what}: {mode} output differs")
        if any(o.requires_grad for o in outs):
            failures.append(f"{what}: {mode} output requires grad")


def _stage_threads():
    import threading

    from fairscale_c.nn.pipe import rpc as pipe_rpc

    return len(pipe_rpc._models) + sum(t.name == "PipeRPCWrapper stage" for t in threading.enumerate())


def _stages_left(workers, world):
    from torch.distributed import rpc

    left = {0: _stage_threads(), **{r: rpc.rpc_sync(workers[r], _stage_threads) for r in range(1, world)}}
    return {r: n for r, n in left.items() if n}


def _job(rank, world, device="cpu"):
    import torch.distributed as dist

    from fairscale_c.nn.model_parallel import destroy_model_parallel, initialize_model_parallel

    join_gloo(rank, world, device)
    failures = []
    try:
        initialize_model_parallel(1, world)
        with rpc_workers(rank, world, "Test") as workers:
            if rank == 0:
                # (balance, chunks, checkpoint, the default group?, worker_map, a tuple output?)
                cases = {
                    2: [([3, 3], 1, "never", False, workers, False), ([5, 2], 3, "except_last", True, None, True)],
                    3: [
                        ([2, 2, 2], 2, "always", False, workers, False),
                        ([1, 4, 2], 4, "except_last", True, None, True),
                    ],
                }[world]
                for balance, chunks, checkpoint, group, worker_map, pair in cases:
                    _train(rank, world, failures, balance, chunks, checkpoint, group, worker_map, pair, device)
                # the wrappers are gone: so are their threads here and their stages on the other ranks
                gc.collect()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and _stages_left(workers, world):
                    time.sleep(0.1)
                if _stages_left(workers, world):
                    failures.append(f"stages left behind: {_stages_left(workers, world)}")
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_training_equals_plain_torch(world):
    assert run_ranks(_job, world, timeout=180) == [[]] * world


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_ranks_equals_plain_torch():
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    assert run_ranks(_job, 2, "cuda", env=nccl_env, timeout=300) == [[]] * 2


def _errors_job(rank, world):
    import torch.distributed as dist

    from fairscale_c.nn.pipe import PipeRPCWrapper

    join_gloo(rank, world)
    seen = []
    try:
        with rpc_workers(rank, world):
            if rank == 0:
                # rank 1's stage raises on its micro-batch (in eval mode stage 0 has sent it and is done)
                pipe = PipeRPCWrapper(nn.Sequential(nn.Linear(4, 4), Boom()), [1, 1], group=dist.group.WORLD).eval()
                start = time.monotonic()
                try:
                    pipe(torch.randn(3, 4))
                except Exception as exc:  # noqa: BLE001 (a RemoteException-carrying error from RPC)
                    seen.append(("stage", "boom in stage 1" in str(exc), time.monotonic() - start < 20))
                try:
                    pipe.foreach_worker(_fail)
                except Exception as exc:  # noqa: BLE001
                    seen.append(("callback", "callback failed on stage 1" in str(exc)))
                try:
                    pipe.foreach_worker("not callable")
                except TypeError as exc:
                    seen.append(("callable", "callback must be callable" in str(exc)))
                # a training step whose backward never ran: the next forward says so
                pipe = PipeRPCWrapper(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], group=dist.group.WORLD)
                out = pipe(torch.randn(3, 4))
                try:
                    pipe(torch.randn(3, 4))
                except RuntimeError as exc:
                    seen.append(("pending", "backward has not run" in str(exc)))
                out.sum().backward()
                pipe(torch.randn(3, 4)).sum().backward()
                seen.append(("after", True))
                try:
                    PipeRPCWrapper(nn.Sequential(nn.Linear(4, 4)), [1], group=dist.new_group([0]))
                except ValueError as exc:
                    seen.append(("group", "group must be the pipeline parallel group" in str(exc)))
                try:
                    PipeRPCWrapper(nn.Sequential(nn.Linear(4, 4)), [1, 1], group=dist.group.WORLD, worker_map={0: "a"})
                except ValueError as exc:
                    seen.append(("worker_map", "worker_map has no worker for global rank 1" in str(exc)))
            else:
                dist.new_group([0])
                try:
                    PipeRPCWrapper(nn.Sequential(nn.Linear(4, 4)), [1], group=dist.group.WORLD)
                except ValueError as exc:
                    seen.append(("rank", "built on rank 0 of its pipeline group (this is rank 1)" in str(exc)))
    finally:
        dist.destroy_process_group()
    return seen


def test_errors_reach_rank_0():
    got = run_ranks(_errors_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=200)
    assert got[0] == [
        ("stage", True, True), ("callback", True), ("callable", True), ("pending", True), ("after", True),
        ("group", True), ("worker_map", True),
    ]  # fmt: skip
    assert got[1] == [("rank", True)]


def _no_rpc_job(rank, world):
    import torch.distributed as dist

    from fairscale_c.nn.pipe import PipeRPCWrapper

    join_gloo(rank, world)
    try:
        PipeRPCWrapper(nn.Sequential(nn.Linear(4, 4)), [1], group=dist.group.WORLD)
    except RuntimeError as exc:
        return "needs torch RPC" in str(exc)
    finally:
        dist.destroy_process_group()
    return False


def test_needs_rpc():
    assert run_ranks(_no_rpc_job, 1, timeout=120) == [True]


def test_alias_and_exports():
    import fairscale_c.nn
    import fairscale_c.nn.pipe
    from fairscale_c.nn.pipe.rpc import PipeRPCWrapper

    assert fairscale_c.nn.PipeRPCWrapper is PipeRPCWrapper
    assert fairscale_c.nn.pipe.PipeRPCWrapper is PipeRPCWrapper
