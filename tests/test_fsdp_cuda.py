"""FullyShardedDataParallel and the distributed package on CUDA tensors (NCCL underneath).

The numerics scenarios of tests/fsdp_scenarios.py run with every model, batch and reference on
the GPU, against single-process PyTorch on that GPU. World 1 needs one GPU; world 2 needs two, or
one GPU with NCCL >= 2.30 (two ranks may then share it). Everything here skips without CUDA.
"""

import os

import pytest
import torch

from dist_utils import run_ranks
from test_cuda import HAS_CUDA, _nccl_devices
from test_fsdp import ALL, spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]


def _world2_env(monkeypatch):
    devices, env = _nccl_devices()  # skips when two ranks cannot have a GPU each or share one
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return devices


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_on_cuda_matches_pytorch(world, monkeypatch):
    if world == 2:
        _world2_env(monkeypatch)
    monkeypatch.setenv("FAIRSCALE_C_TEST_DEVICE", "cuda")
    spawn(world, ALL)


def _group_on_cuda(rank, world):
    import torch.distributed as dist

    from fairscale_c import distributed as fdist

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    try:
        with fdist.init_group() as group:
            # CUDA tensors go to NCCL, host tensors to the shared-memory engine, through one group.
            t = torch.full((1000,), float(rank + 1), device=dev)
            work = group.all_reduce(t, op="sum", async_op=True)
            work.wait()
            host = torch.full((10,), float(rank + 1))
            group.all_reduce(host, op="max")
            out = torch.empty(world * 3, device=dev)
            group.all_gather(out, torch.arange(3, device=dev, dtype=torch.float32) + 10 * rank)
            shard = torch.empty(2, dtype=torch.bfloat16, device=dev)
            group.reduce_scatter(shard, torch.ones(2 * world, dtype=torch.bfloat16, device=dev), op="avg")
            torch.cuda.synchronize()
            try:
                group.all_gather(torch.empty(world * 3), torch.ones(3, device=dev))
            except ValueError as e:
                mixed = str(e)
            else:
                mixed = ""
            return {
                "sum": t[:3].tolist(),
                "max": host[0].item(),
                "gather": out.tolist(),
                "rs": shard.float().tolist(),
                "mixed": mixed,
            }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_group_routes_cuda_tensors_to_nccl(world, monkeypatch):
    env = {}
    if world == 2:
        _world2_env(monkeypatch)
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    results = run_ranks(_group_on_cuda, world, env=env, timeout=240)
    total = float(sum(range(1, world + 1)))
    expected_gather = [float(x + 10 * r) for r in range(world) for x in range(3)]
    for res in results:
        assert res["sum"] == [total] * 3
        assert res["max"] == float(world)
        assert res["gather"] == expected_gather
        assert res["rs"] == [1.0, 1.0]
        assert "expected the same device" in res["mixed"], res["mixed"]


def _dead_peer_on_cuda(rank, world):
    """FSDP on CUDA; rank 1 dies after one healthy step. Returns (message, seconds) on rank 0."""
    import time

    import torch.distributed as dist
    from torch import nn

    from fairscale_c import DistributedError
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(FSDP(nn.Linear(8, 16).to(dev)), nn.ReLU(), nn.Linear(16, 4).to(dev)))
    x = torch.randn(4, 8, device=dev)
    model(x).sum().backward()  # one healthy step on both ranks
    torch.cuda.synchronize()
    if rank == 1:
        os._exit(3)  # dies mid-training without any cleanup
    t0 = time.monotonic()
    try:
        for _ in range(5):
            model(x).sum().backward()
            torch.cuda.synchronize()
    except DistributedError as e:
        return str(e), time.monotonic() - t0
    raise AssertionError("the dead peer was not reported")


def test_dead_peer_on_cuda_raises_within_the_timeout():
    """A rank killed mid-step on the GPU: the survivor's next NCCL wait raises DistributedError
    within FAIRSCALE_C_TIMEOUT (the watchdog aborts the communicator), never a hang."""
    env = {"FAIRSCALE_C_TIMEOUT": "20"}
    _, extra = _nccl_devices()
    env.update(extra)
    results = run_ranks(_dead_peer_on_cuda, 2, env=env, may_die=[1], timeout=180)
    message, seconds = results[0]
    print(f"survivor raised after {seconds:.1f} s: {message}")
    assert seconds < 20 + 30, (seconds, message)
    assert "abort" in message or "timed out" in message or "rank 1" in message, message
