"""fairscale_c.nn.moe: Top2Gate's routing against a token-by-token reference written from GShard's
algorithm, its noise against torch.distributions' Gumbel, and MOELayer at 1, 2 and 4 ranks against
a single-process reference (each token's output is the gate-weighted sum of its two experts
applied to it): outputs, input gradients, the gate's and every expert's gradients; the dense path
(another gate) equal to the compact one; expert parameters marked; bad input."""

import importlib.util
import math

import pytest
import torch
from torch import nn

from fairscale_c.nn import MOELayer, Top2Gate
from fairscale_c.nn.moe.top2gate import gumbel_rsample, top2_routing, top2gating

D = 8


# ------------------------------------------------------------------ the gate


def _reference_gating(logits, noise):
    """GShard's top-2 gating, token by token: (l_aux, combine (S, E, C))."""
    S, E = logits.shape
    C = 2 * S // E
    gates = torch.softmax(logits.double(), dim=1)
    first = [int(torch.argmax(gates[s])) for s in range(S)]
    second = []
    for s in range(S):
        noisy = (logits[s] + noise[s]).double().clone()
        noisy[first[s]] = -math.inf
        second.append(int(torch.argmax(noisy)))
    count = [0] * E
    slot1 = []
    for s in range(S):
        slot1.append(count[first[s]])
        count[first[s]] += 1
    slot2 = []  # second choices queue behind every first choice of their expert
    for s in range(S):
        slot2.append(count[second[s]])
        count[second[s]] += 1
    combine = torch.zeros(S, E, C, dtype=torch.float64)
    for s in range(S):
        g1 = gates[s, first[s]] if slot1[s] < C else 0.0
        g2 = gates[s, second[s]] if slot2[s] < C else 0.0
        denom = max(g1 + g2, torch.finfo(torch.float32).eps)
        if slot1[s] < C:
            combine[s, first[s], slot1[s]] = g1 / denom
        if slot2[s] < C:
            combine[s, second[s], slot2[s]] = g2 / denom
    share = torch.tensor([first.count(e) / S for e in range(E)], dtype=torch.float64)
    l_aux = (gates.mean(dim=0) * share).mean()
    return l_aux, combine


def test_gumbel_noise_is_torch_distributions_gumbel_draw_for_draw():
    torch.manual_seed(5)
    ours = gumbel_rsample((7, 3), torch.device("cpu"))
    torch.manual_seed(5)
    theirs = torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample((7, 3))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("tokens,experts", [(12, 6), (64, 4), (96, 8), (10, 1)])
def test_top2gating_equals_the_token_by_token_reference(tokens, experts):
    torch.manual_seed(tokens)
    logits = torch.randn(tokens, experts)
    if tokens == 96:  # skewed: most tokens prefer expert 0, so its capacity overflows
        logits[:, 0] += 2.0
    torch.manual_seed(11)
    noise = gumbel_rsample((tokens, experts), logits.device)
    torch.manual_seed(11)
    l_aux, combine, dispatch = top2gating(logits)
    want_aux, want = _reference_gating(logits, noise)
    assert combine.shape == (tokens, experts, 2 * tokens // experts) and combine.dtype == torch.float32
    assert torch.allclose(combine.double(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(dispatch, want != 0)
    assert math.isclose(l_aux.item(), want_aux.item(), rel_tol=1e-6)
    if tokens == 96:
        assert ((want != 0).sum(dim=(1, 2)) < 2).any()  # some choices were dropped
    # the compact form says the same
    torch.manual_seed(11)
    r = top2_routing(logits)
    for k in range(2):
        got = torch.zeros_like(want)
        got[torch.arange(tokens), r.experts[:, k], r.slots[:, k]] = r.weights[:, k].double()
        assert torch.allclose(got, want * (got != 0), rtol=1e-6, atol=1e-7)


def test_top2_gate_matches_fairscales_published_value():
    # FairScale's own test: seed 3, 12 tokens of width 4, 6 experts: l_aux 0.0267 (1%)
    torch.manual_seed(3)
    x = torch.randn(12, 4)
    l_aux, combine, dispatch = Top2Gate(4, 6)(x)
    assert math.isclose(l_aux.item(), 0.0267, rel_tol=0.01)
    assert combine.shape == dispatch.shape == (12, 6, 4)
    assert torch.allclose(combine.sum(dim=(1, 2)), torch.ones(12))  # nothing dropped at this size


@pytest.mark.skipif(importlib.util.find_spec("fairscale") is None, reason="fairscale (0.4.13) is not importable")
def test_top2gating_is_fairscales_bit_for_bit():
    from fairscale.nn.moe.top2gate import top2gating as theirs

    if theirs is top2gating:
        pytest.skip("fairscale is the alias of fairscale_c here")
    for tokens, experts in ((12, 6), (1000, 8), (30, 1)):
        torch.manual_seed(tokens)
        logits = torch.randn(tokens, experts, requires_grad=True)
        results = []
        for fn in (theirs, top2gating):
            torch.manual_seed(7)
            out = fn(logits)
            weight = torch.arange(out[1].numel(), dtype=torch.float32).reshape(out[1].shape)
            grad = torch.autograd.grad((out[1] * weight).sum() + out[0], logits)[0]
            results.append((*out, grad, torch.rand(1)))  # the last: both drew as much noise
        assert all(torch.equal(a, b) for a, b in zip(*results))


def test_gate_errors_name_the_argument():
    with pytest.raises(ValueError, match="'num_experts' must be a positive int"):
        Top2Gate(4, 0)
    with pytest.raises(ValueError, match="'model_dim' must be a positive int"):
        Top2Gate(2.5, 4)
    with pytest.raises(ValueError, match=r"number of tokens \(10\) must be a multiple of the number of experts \(4\)"):
        top2gating(torch.randn(10, 4))
    with pytest.raises(ValueError, match="'logits' must be 2-D"):
        top2gating(torch.randn(2, 4, 4))


# ------------------------------------------------------------------ the layer


def _expert(e):
    torch.manual_seed(100 + e)
    return nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))


def _gate(experts):
    torch.manual_seed(0)
    return Top2Gate(D, experts)


def _tokens(rank, seq):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(seq, 6, D, generator=g)


def _reference(world, local, seq, device="cpu"):
    """Every rank's outputs and gradients, in one process: token s of rank r gives
    sum_k weight_k * expert_k(token). (On `device`: the gate's noise comes from its generator.)"""
    experts = [_expert(e).to(device) for e in range(world * local)]
    gates = [_gate(world * local).to(device) for _ in range(world)]  # each rank's replica: its own gradient
    outs, xs, total = [], [], 0.0
    for rank in range(world):
        x = _tokens(rank, seq).to(device).requires_grad_()
        tokens = x.reshape(-1, D)
        torch.manual_seed(50 + rank)
        l_aux, combine, _ = top2gating(gates[rank].wg(tokens))
        weights = combine.sum(dim=2)  # (S, E): a token has at most one slot per expert
        out = sum(weights[:, e : e + 1] * experts[e](tokens) for e in range(world * local))
        outs.append(out.reshape(x.shape))
        xs.append(x)
        total = total + out.pow(2).sum() + l_aux
    total.backward()
    return _as(
        {
            "out": [o.detach() for o in outs],
            "x_grad": [x.grad for x in xs],
            "gate_grad": [g.wg.weight.grad for g in gates],
            "expert_grads": [[p.grad for p in e.parameters()] for e in experts],
        },
        torch.Tensor.cpu,
    )


def _run_layer(rank, world, local, seq, gate_kind="top2", device="cpu"):
    gate = _gate(world * local).to(device)
    if gate_kind == "dense":
        gate = _DenseGate(gate)
    mine = [_expert(rank * local + i).to(device) for i in range(local)]
    moe = MOELayer(gate, nn.ModuleList(mine) if local > 1 else mine[0])
    x = _tokens(rank, seq).to(device).requires_grad_()
    torch.manual_seed(50 + rank)
    out = moe(x)
    (out.pow(2).sum() + moe.l_aux).backward()
    inner = gate.inner if gate_kind == "dense" else gate
    return {
        "out": out.detach().cpu(),
        "x_grad": x.grad.cpu(),
        "gate_grad": inner.wg.weight.grad.cpu(),
        "expert_grads": [[p.grad.cpu() for p in e.parameters()] for e in mine],
        "marked": all(getattr(p, "expert", False) for e in mine for p in e.parameters()),
        "gate_marked": any(hasattr(p, "expert") for p in gate.parameters()),
    }


class _DenseGate(nn.Module):
    """Top2Gate behind another module: MOELayer takes FairScale's dense path."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, tokens):
        return self.inner(tokens)


TOL = dict(rtol=1e-4, atol=1e-5)


def _compare(got, want, rank, local):
    assert torch.allclose(got["out"], want["out"][rank], **TOL)
    assert torch.allclose(got["x_grad"], want["x_grad"][rank], **TOL)
    assert torch.allclose(got["gate_grad"], want["gate_grad"][rank], **TOL)
    for i, grads in enumerate(got["expert_grads"]):
        for g, w in zip(grads, want["expert_grads"][rank * local + i]):
            assert torch.allclose(g, w, **TOL)
    assert got["marked"] and not got["gate_marked"]


@pytest.mark.parametrize("gate_kind", ["top2", "dense"])
def test_moe_layer_in_one_process_equals_the_reference(gate_kind):
    want = _reference(1, 4, seq=4)
    _compare(_run_layer(0, 1, 4, 4, gate_kind), want, 0, 4)


def _as(result, convert):
    """`result` with every tensor (array) converted by `convert`."""
    if isinstance(result, dict):
        return {k: _as(v, convert) for k, v in result.items()}
    if isinstance(result, list):
        return [_as(v, convert) for v in result]
    return result if isinstance(result, bool) else convert(result)


def _layer_job(rank, world, local, seq, device="cpu"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:  # tensors travel back as numpy arrays (torch's queue pickling shares fds with the exiting rank)
        return [
            _as(_run_layer(rank, world, local, seq, kind, device), torch.Tensor.numpy) for kind in ("top2", "dense")
        ]
    finally:
        dist.destroy_process_group()


def _copy_job(rank, world):
    import copy

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        moe = MOELayer(_gate(world), _expert(rank))
        twin = copy.deepcopy(moe)  # the group is shared, not copied (a ProcessGroup cannot be)
        x = _tokens(rank, 2)
        torch.manual_seed(7)
        a = moe(x)
        torch.manual_seed(7)
        b = twin(x)
        with torch.no_grad():
            twin.experts[0][0].weight.add_(1)
        return [
            twin.group is moe.group,
            torch.equal(a, b),
            not torch.equal(twin.experts[0][0].weight, moe.experts[0][0].weight),
        ]
    finally:
        dist.destroy_process_group()


def test_moe_layer_deep_copies():
    from dist_utils import run_ranks

    assert run_ranks(_copy_job, 2, timeout=120) == [[True, True, True]] * 2


@pytest.mark.parametrize("world,local", [(2, 1), (2, 2), (4, 1)])
def test_moe_layer_across_ranks_equals_the_reference(world, local):
    from dist_utils import run_ranks

    seq = 2 * local
    results = run_ranks(_layer_job, world, local, seq, timeout=240)
    want = _reference(world, local, seq)
    for rank, (top2, dense) in enumerate(results):
        top2, dense = _as(top2, torch.from_numpy), _as(dense, torch.from_numpy)
        _compare(top2, want, rank, local)
        _compare(dense, want, rank, local)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_layer_on_cuda_ranks_equals_the_reference():
    from dist_utils import run_ranks
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    results = run_ranks(_layer_job, 2, 2, 4, "cuda", env=nccl_env, timeout=240)
    # the reference on the GPU too, so that the gate's noise comes from the same generator
    want = _reference(2, 2, 4, "cuda")
    for rank, (top2, dense) in enumerate(results):
        _compare(_as(top2, torch.from_numpy), want, rank, 2)
        _compare(_as(dense, torch.from_numpy), want, rank, 2)


def test_moe_layer_bad_input_raises_naming_the_argument():
    moe = MOELayer(_gate(2), nn.ModuleList([_expert(0), _expert(1)]))
    assert moe.world_size == 1 and moe.num_local_experts == 2
    with pytest.raises(ValueError, match="'input' must have 3 dimensions"):
        moe(torch.randn(4, D))
    with pytest.raises(ValueError, match="expected one input tensor, got 2"):
        moe(torch.randn(2, 3, D), torch.randn(2, 3, D))
    with pytest.raises(ValueError, match=r"dim 0 of 'input' \(3\) must be a multiple of the number of local experts"):
        moe(torch.randn(3, 2, D))
    with pytest.raises(TypeError, match="'input' must be a Tensor"):
        moe([1.0])
    wrong = MOELayer(_gate(4), nn.ModuleList([_expert(0), _expert(1)]))
    with pytest.raises(ValueError, match="routes to 4 experts, but the group's 1 ranks x 2 local experts make 2"):
        wrong(torch.randn(2, 4, D))
    with pytest.raises(TypeError, match="'gate' must be an nn.Module"):
        MOELayer(lambda t: t, _expert(0))
    with pytest.raises(ValueError, match="empty ModuleList"):
        MOELayer(_gate(2), nn.ModuleList())
