"""fairscale_c.internal (FairScale's fairscale.internal helpers): ProcessGroupName is the class FSDP
takes, the process-group cache over 2 ranks, the container, parameter, state-dict, object and
version helpers against what they are documented to do, and their misuse."""

import math
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from torch import nn

from fairscale_c.internal import containers, object as pyobj, params, parallel, state_dict, torch_version


def test_process_group_name_is_the_one_fsdp_takes():
    from fairscale_c.nn.data_parallel import ProcessGroupName

    assert parallel.ProcessGroupName is ProcessGroupName
    assert ProcessGroupName("reduce_scatter") is ProcessGroupName.reduce_scatter


def _cache_job(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        a = parallel.get_process_group_cached()
        b = parallel.get_process_group_cached(parallel.ProcessGroupName.default)
        rs = parallel.get_process_group_cached(parallel.ProcessGroupName.reduce_scatter)
        sub = parallel.get_process_group_cached(ranks=[1, 0, 1])
        sub2 = parallel.get_process_group_cached(ranks=(0, 1))
        t = torch.ones(1)
        dist.all_reduce(t, group=rs)
        return [a is b, rs is not a, sub is sub2, sub is not a, t.item(), dist.get_world_size(rs)]
    finally:
        dist.destroy_process_group()


def test_process_group_cache_gives_one_group_per_name_and_ranks():
    from dist_utils import run_ranks

    for result in run_ranks(_cache_job, 2, timeout=120):
        assert result == [True, True, True, True, 2.0, 2]
    with pytest.raises(RuntimeError, match="not yet initialized"):
        parallel.get_process_group_cached()


def test_chunk_and_pad():
    for n, chunks in ((10, 3), (1, 4), (8, 4), (0 + 5, 8)):
        got = parallel.chunk_and_pad(torch.arange(1.0, n + 1), chunks)
        assert len(got) == chunks and len({c.numel() for c in got}) == 1
        flat = torch.cat(got)
        assert torch.equal(flat[:n], torch.arange(1.0, n + 1)) and torch.count_nonzero(flat[n:]) == 0


Point = namedtuple("Point", "x y")


def test_containers():
    t = torch.ones(2)
    nested = {"a": [t, (t, 3)], "b": OrderedDict(c=Point(t, "s")), "d": {5}}
    out = containers.apply_to_tensors(lambda x: x * 2, nested)
    assert torch.equal(out["a"][0], 2 * t) and torch.equal(out["a"][1][0], 2 * t) and out["a"][1][1] == 3
    assert isinstance(out["b"], OrderedDict) and isinstance(out["b"]["c"], Point)
    assert torch.equal(out["b"]["c"].x, 2 * t) and out["b"]["c"].y == "s" and out["d"] == {5}
    arrays = containers.to_np({"k": [t]})
    assert isinstance(arrays["k"][0], np.ndarray)
    assert torch.equal(containers.from_np(arrays)["k"][0], t)
    keys, flat = containers.pack_kwargs(1, 2, a=3, b=4)
    assert keys == ("a", "b") and flat == (1, 2, 3, 4)
    assert containers.unpack_kwargs(keys, flat) == ((1, 2), {"a": 3, "b": 4})
    assert containers.unpack_kwargs((), flat) == (flat, {})
    with pytest.raises(AssertionError, match="too many keys 5 vs. 4"):
        containers.unpack_kwargs(("a", "b", "c", "d", "e"), flat)
    x, y = torch.zeros(1), torch.ones(1)
    tensors, packed = containers.split_non_tensors((None, x, 3, y))
    assert tensors == (x, y) and packed == {"is_tensor": [False, True, False, True], "objects": [None, 3]}
    assert containers.unpack_non_tensors(tensors, packed) == (None, x, 3, y)
    assert containers.split_non_tensors(x) == ((x,), None)
    with pytest.raises(AssertionError, match="expected the dict"):
        containers.unpack_non_tensors(tensors, [1])
    with pytest.raises(AssertionError, match="len\\(tensors\\) 1"):
        containers.unpack_non_tensors((x,), packed)


def test_params():
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net(torch.randn(5, 3)).pow(2).sum().backward()
    ps = list(net.parameters())
    want = torch.norm(torch.cat([p.grad.reshape(-1) for p in ps]))
    assert math.isclose(params.calc_grad_norm(ps, 2).item(), want.item(), rel_tol=1e-6)
    want_inf = max(p.grad.abs().max() for p in ps)
    assert params.calc_grad_norm(ps, math.inf).item() == want_inf.item()
    assert params.calc_grad_norm([nn.Parameter(torch.ones(2))], 2).item() == 0.0  # no gradient
    copied = params.recursive_copy_to_device({"a": [torch.ones(1), (torch.zeros(1), "s")]}, False, torch.device("cpu"))
    assert copied["a"][1][1] == "s" and isinstance(copied["a"][1], tuple)


@pytest.mark.parametrize("p", [2.0, math.inf, 1.0, 3.0, -math.inf, -1.0])
def test_grad_norm_term_is_the_norm_of_every_gradient_to_the_power_p(p):
    # C's path (contiguous float32, float16 and bfloat16 on the host, p = 2 and inf) and torch's
    # (a non-contiguous view, float64, other p) together, as a rank of FSDP or OSS holds them
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(1000, generator=gen),
        torch.randn(64, 48, generator=gen).t(),
        torch.randn(300, generator=gen).bfloat16(),
        torch.randn(200, generator=gen).half(),
        torch.randn(50, generator=gen, dtype=torch.float64),
    ]
    flat = torch.cat([g.double().reshape(-1) for g in grads])
    want = flat.abs().max() if p == math.inf else flat.abs().min() if p == -math.inf else flat.abs().pow(p).sum()
    got = params.grad_norm_term(grads, p)
    assert got.shape == (1,) and got.dtype == torch.float64 and got.device.type == "cpu"
    assert math.isclose(got.item(), want.item(), rel_tol=1e-5)
    assert params.grad_norm_term([], p).tolist() == [math.inf if p == -math.inf else 0.0]
    nan = torch.tensor([1.0, math.nan])
    for with_nan in ([nan] + grads, grads + [nan]):  # wherever it is, a NaN makes the norm NaN
        assert math.isnan(params.grad_norm_term(with_nan, p).item())


class _NcclLikeComm:
    """Two ranks' all_reduce with NCCL's arithmetic: its max drops a NaN (as torch.fmax does)."""

    def __init__(self, other):
        self.other = other

    def all_reduce(self, t, op):
        t.copy_({"max": torch.fmax, "min": torch.fmin}.get(op, torch.add)(t, self.other))


def test_norm_type_zero_is_refused():
    with pytest.raises(ValueError, match="argument 'norm_type' must be a number other than 0"):
        params.grad_norm_term([torch.ones(2)], 0)


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_reduce_norm_term_keeps_a_nan_from_any_rank(p):
    # the other rank's term for p = inf carries its NaN flag (0: none)
    mine, theirs = torch.tensor([2.0]), torch.tensor([3.0, 0.0] if p == math.inf else [7.0])
    assert params.reduce_norm_term(_NcclLikeComm(theirs), mine.clone(), p).item() == 3.0
    nan = torch.tensor([math.nan])
    assert math.isnan(params.reduce_norm_term(_NcclLikeComm(theirs), nan, p).item())
    if p == math.inf:  # the NaN on the other rank: its flag is 1
        assert math.isnan(params.reduce_norm_term(_NcclLikeComm(torch.tensor([math.nan, 1.0])), mine, p).item())


def test_reduce_norm_term_minimum_keeps_a_nan_from_any_rank():
    # p = -inf: the smallest |g| over the ranks; the NaN flag travels negated, reduced by "min"
    mine, theirs = torch.tensor([2.0], dtype=torch.float64), torch.tensor([3.0, -0.0], dtype=torch.float64)
    assert params.reduce_norm_term(_NcclLikeComm(theirs), mine.clone(), -math.inf).item() == 2.0
    nan_there = torch.tensor([math.nan, -1.0], dtype=torch.float64)
    assert math.isnan(params.reduce_norm_term(_NcclLikeComm(nan_there), mine.clone(), -math.inf).item())
    nan_here = torch.tensor([math.nan], dtype=torch.float64)
    assert math.isnan(params.reduce_norm_term(_NcclLikeComm(theirs), nan_here, -math.inf).item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("p", [2.0, math.inf])
def test_grad_norm_term_on_cuda_equals_the_host_term(p):
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(4096, generator=gen), torch.randn(77, generator=gen).half()]
    grads.append(torch.randn(33, generator=gen, dtype=torch.float64))
    host = params.grad_norm_term(grads, p)
    got = params.grad_norm_term([g.cuda() for g in grads], p)
    assert got.device.type == "cuda" and got.dtype == torch.float64
    assert math.isclose(got.item(), host.item(), rel_tol=1e-5)


def test_state_dict_helpers():
    net = nn.Sequential(
        nn.Linear(1, 1), nn.ModuleDict({"ln": nn.LayerNorm(1), "lin": nn.Linear(1, 1)}), nn.LayerNorm(1)
    )
    found = state_dict.find_module_instances(net, nn.LayerNorm)
    assert [p for p, _ in found] == ["1.ln.", "2."] and found[1][1] is net[2]
    assert state_dict.find_module_instances(net, nn.Sequential) == [("", net)]
    sd = {"layer.x": torch.tensor(1), "other": torch.tensor(2)}
    state_dict.replace_by_prefix_(sd, "layer.", "module.layer.")
    assert set(sd) == {"module.layer.x", "other"}
    with pytest.raises(ValueError, match="must be distinct"):
        state_dict.replace_by_prefix_(sd, "a", "a")


def test_object_and_version_helpers():
    t = pyobj.pyobject_to_tensor({"k": [1, 2]}, fixed_buffer_size=100)
    assert t.dtype == torch.uint8 and t.numel() == 100
    assert pyobj.tensor_to_pyobject(t) == {"k": [1, 2]}
    with pytest.raises(ValueError, match="message too big"):
        pyobj.pyobject_to_tensor(list(range(100)), fixed_buffer_size=10)
    assert torch_version("2.13.0+cpu") == (2, 13, 0)
    assert torch_version("1.8.0a0fb") == (1, 8, 0)
    assert torch_version("nonsense") == ()
    assert torch_version() == tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:3])


def _bucketer_job(rank, world, cap_mb):
    import torch.distributed as dist

    from fairscale_c.internal.reduce_scatter_bucketer import ReduceScatterBucketer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        bucketer = ReduceScatterBucketer(bucket_cap_mb=cap_mb)
        got = {}
        sizes = {"small": 3, "big": 300_000, "small2": 5}  # big: more than a 1 MiB bucket's share

        def inputs(name, r):
            g = torch.Generator().manual_seed(len(name) * 100 + r)
            return [torch.randn(sizes[name], generator=g) for _ in range(world)]

        for name in sizes:
            bucketer.reduce_scatter_async(
                inputs(name, rank), group, callback_fn=lambda out, k=name: got.update({k: out.clone()})
            )
        early = sorted(got)
        bucketer.flush()
        failures = []
        for name in sizes:
            want = sum(inputs(name, r)[rank] for r in range(world))
            if not torch.allclose(got[name], want, rtol=1e-6, atol=1e-6):
                failures.append(name)
        bucketer.teardown()
        bucketer.reduce_scatter_async(
            inputs("small", rank), group, callback_fn=lambda out: got.update(again=out.clone())
        )
        bucketer.flush()  # set up again after the teardown
        if not torch.allclose(got["again"], sum(inputs("small", r)[rank] for r in range(world)), rtol=1e-6, atol=1e-6):
            failures.append("after teardown")
        return early, failures
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cap_mb", [1, 0])
def test_reduce_scatter_bucketer_sums_each_ranks_block(cap_mb):
    from dist_utils import run_ranks

    for early, failures in run_ranks(_bucketer_job, 2, cap_mb, timeout=120):
        assert failures == []
        # bucketed inputs wait for flush(); one too big for a bucket (or every one, unbucketed) runs at once
        assert early == (["big"] if cap_mb else ["big", "small", "small2"])
