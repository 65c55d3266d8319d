"""fairscale_c.experimental.nn.MEVO against plain torch: loss and input/weight gradients equal
cross_entropy over the full logits (float64: to rounding; float32 and bfloat16: within their
precision) for every tiling, 3-D inputs, sum and mean; LMCL against its explicit formula; tied
weights and gradient accumulation; eval mode; FairScale's MEVO where importable; under FSDP at
world 2 with the weight tied to an embedding; bad input."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dist_utils import not_close, run_ranks
from fairscale_c.experimental.nn import MEVO, BaselineSoftmaxNllLoss
from fairscale_c.experimental.nn.mevo import get_data


def _case(tokens, d, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.nn.Parameter(torch.randn(vocab, d, generator=g, dtype=torch.float64).to(dtype))
    target = torch.randint(0, vocab, (tokens,), generator=g)
    return x, w, target


def _reference(x, w, target, reduction="sum", margin=0.35, scale=None):
    """Loss and gradients in float64 over the full logits."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    if scale is None:
        logits = x64 @ w64.T
    else:
        logits = F.normalize(x64, dim=1) @ F.normalize(w64, dim=1).T
        logits = scale * (logits - margin * F.one_hot(target, w.shape[0]).double())
    loss = F.cross_entropy(logits, target, reduction=reduction)
    loss.backward()
    return loss.detach(), x64.grad, w64.grad


def _run(x, w, target, **kwargs):
    x.grad = w.grad = None
    loss = MEVO(w, **kwargs)(x, target)
    loss.backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("tile_factor", [1, 3, 16, 1000])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("scale", [None, 8.0])
def test_float64_equals_cross_entropy_over_the_full_logits(tile_factor, reduction, scale):
    x, w, target = _case(37, 16, 101, torch.float64)
    got = _run(x, w, target, tile_factor=tile_factor, reduction=reduction, scale=scale)
    want = _reference(x, w, target, reduction, scale=scale)
    for name, a, b in zip(("loss", "input grad", "weight grad"), got, want):
        assert not not_close(a, b, rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_lower_precisions_stay_close(dtype, tol):
    x, w, target = _case(64, 32, 300, dtype)
    got = _run(x, w, target, tile_factor=4)
    want = _reference(x, w, target)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    for name, a, b in zip(("loss", "input grad", "weight grad"), got, want):
        assert not not_close(a.double(), b, rtol=tol, atol=tol * float(b.abs().max())), name


def test_three_dimensional_input_and_eval_mode():
    x, w, target = _case(24, 8, 50, torch.float64)
    mevo = MEVO(w, tile_factor=4)
    loss = mevo(x.view(2, 12, 8), target.view(2, 12))
    assert torch.allclose(loss, _reference(x, w, target)[0], rtol=1e-12)
    mevo.eval()
    logits = mevo(x.detach().view(2, 12, 8), None)
    assert logits.shape == (2, 12, 50) and torch.equal(logits, x.detach().view(2, 12, 8) @ w.detach().T)
    assert torch.allclose(mevo(x, target), loss)  # eval with a target: still the loss


def test_gradients_accumulate_and_reach_a_tied_embedding():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(40, 8).double()
    mevo = MEVO(emb.weight, tile_factor=4)
    ref = copy.deepcopy(emb)
    ids, target = torch.randint(0, 40, (2, 10)), torch.randint(0, 40, (2, 10))
    for _ in range(2):  # two backwards accumulate
        mevo(torch.tanh(emb(ids)), target).backward()
        h = torch.tanh(ref(ids))
        F.cross_entropy((h @ ref.weight.T).view(-1, 40), target.view(-1), reduction="sum").backward()
    assert not not_close(emb.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(mevo.trigger.trigger.grad, torch.zeros(1, dtype=torch.float64))
    assert set(mevo.state_dict()) == {"proj_weight", "trigger.trigger"}  # FairScale's keys


def test_matches_fairscales_mevo():
    fs = pytest.importorskip("fairscale.experimental.nn.mevo")
    x, w, target = _case(37, 16, 101, torch.float32)
    ours = _run(x, w, target, tile_factor=4)
    x.grad = w.grad = None
    loss = fs.MemoryEfficientVocabOutput(w, tile_factor=4)(x, target)
    loss.backward()
    for a, b in zip(ours, (loss.detach(), x.grad, w.grad)):
        assert not not_close(a, b, rtol=1e-5, atol=1e-5)


def test_baseline_and_get_data_work_on_cpu():
    x, w, target = get_data(((6, 4), (4, 9)), dtype=torch.float32, device="cpu")
    base = BaselineSoftmaxNllLoss(w)(x, target)
    assert torch.allclose(base, MEVO(w)(x, target), rtol=1e-5)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda w: MEVO(w.detach()), TypeError, "'proj_weight' must be a 2-D nn.Parameter"),
        (lambda w: MEVO(w, tile_factor=0), ValueError, "'tile_factor' must be an int >= 1"),
        (lambda w: MEVO(w, reduction="none"), ValueError, "'reduction' must be 'sum' or 'mean'"),
        (lambda w: MEVO(w)(torch.randn(3, 5), torch.zeros(3, dtype=torch.long)), ValueError, "has width 5"),
        (lambda w: MEVO(w)(torch.randn(3, 4), torch.zeros(2, dtype=torch.long)), ValueError, "expected \\(3,\\)"),
        (lambda w: MEVO(w)(torch.randn(3, 4), torch.zeros(3)), TypeError, "int64 class indices"),
        (lambda w: MEVO(w)(torch.randn(3, 4), torch.full((3,), 7)), ValueError, r"outside \[0, 7\)"),
        (lambda w: MEVO(w)(torch.randn(3, 4), None), TypeError, "must be tensors in training"),
    ],
)
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make(torch.nn.Parameter(torch.randn(7, 4)))


class _LM(torch.nn.Module):
    """Embedding, a layer, and the output projection tied to the embedding: through MEVO, or
    (the reference) cross_entropy over the full logits."""

    def __init__(self, mevo=True):
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(64, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.mevo = MEVO(self.emb.weight, tile_factor=4, reduction="mean") if mevo else None

    def forward(self, ids, target):
        h = self.body(self.emb(ids))
        if self.mevo is None:
            return F.cross_entropy((h @ self.emb.weight.T).view(-1, 64), target.view(-1))
        return self.mevo(h, target)


def _fsdp_job(rank, world):
    import torch.distributed as dist

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(5)
        ids, target = torch.randint(0, 64, (4, 6), generator=g), torch.randint(0, 64, (4, 6), generator=g)
        ref = _LM(mevo=False)
        model = FSDP(_LM())
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
        rows = slice(2 * rank, 2 * rank + 2)
        losses = []
        for _ in range(3):
            for m, o, (i, t) in ((ref, opts[0], (ids, target)), (model, opts[1], (ids[rows], target[rows]))):
                o.zero_grad()
                loss = m(i, t)
                loss.backward()
                o.step()
                losses.append(loss.item())
        with model.summon_full_params():
            diff = max((p - q).abs().max().item() for p, q in zip(model.module.emb.parameters(), ref.emb.parameters()))
        return diff, math.isfinite(sum(losses))
    finally:
        dist.destroy_process_group()


def test_under_fsdp_with_the_weight_tied_to_an_embedding():
    """Each rank holds half the batch; FSDP averages the gradients, so after three SGD steps the
    tied embedding equals the one trained on the whole batch in one process without MEVO."""
    for diff, finite in run_ranks(_fsdp_job, 2, timeout=120):
        assert finite and diff < 1e-5, diff


def test_under_autocast_the_backward_recomputes_what_the_forward_computed():
    """Forward under CPU autocast (the logits' matmuls in bfloat16), backward outside it, as
    training loops do: the backward replays the forward's autocast state, so the gradients equal
    those of a backward run inside the autocast region, and are close to the unfused layer's."""
    x, w, target = _case(48, 32, 200, torch.float32)
    results = []
    for backward_inside in (False, True):
        x.grad = w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = MEVO(w, tile_factor=4)(x, target)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        results.append((x.grad, w.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    x.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy((x @ w.T).float(), target, reduction="sum")
    loss.backward()
    for a, b in zip(results[0], (x.grad, w.grad)):
        assert not not_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
