"""OSS steps large CPU parameters in cache-sized blocks (fairscale_c/optim/_blocked.py): the result
must be bit for bit the whole-tensor step's, and the optimizer must look untouched afterwards."""

import copy

import pytest
import torch

from fairscale_c.optim import OSS
from fairscale_c.optim import _blocked
from fairscale_c.optim._blocked import stepped_in_blocks

# A parameter above the blocking threshold whose size is not a multiple of the block, a 2-D one
# above it, and a small one below it.
SHAPES = [(_blocked._MIN_ELEMENTS * 2 + 77,), (1100, 1000), (1000,)]

CASES = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, maximize=True)),
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.Adam, dict(lr=1e-3, weight_decay=0.1, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=1e-3, betas=(0.8, 0.99))),
    (torch.optim.AdamW, dict(lr=1e-3, maximize=True, foreach=False)),
]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _train(cls, kw, blocked, steps=4):
    params = _params()
    opt = cls(params, **kw)
    for s in range(steps):
        _grads(params, s)
        if blocked:
            with stepped_in_blocks(opt):
                opt.step()
        else:
            opt.step()
    return params, opt


def _assert_same_state(a, b, pa, pb):
    for x, y in zip(pa, pb):
        sa, sb = a.state.get(x, {}), b.state.get(y, {})
        assert sa.keys() == sb.keys()
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert torch.equal(sa[k], sb[k]), k
            else:
                assert sa[k] == sb[k], k


@pytest.mark.parametrize("cls,kw", CASES, ids=lambda c: getattr(c, "__name__", None) or str(sorted(c)))
def test_blocked_step_is_bit_identical(cls, kw):
    whole, opt_whole = _train(cls, kw, blocked=False)
    blocked, opt_blocked = _train(cls, kw, blocked=True)
    for a, b in zip(whole, blocked):
        assert torch.equal(a, b)
    _assert_same_state(opt_whole, opt_blocked, whole, blocked)
    # nothing of the blocks is left behind: only the real parameters have state, the groups hold them
    assert all(any(p is q for q in blocked) for p in opt_blocked.state)
    assert opt_blocked.param_groups[0]["params"] == blocked
    assert opt_blocked.state_dict()["param_groups"] == opt_whole.state_dict()["param_groups"]


def _group_sizes_seen(opt, params, steps=2):
    """How many tensors the optimizer's first group held at each step (blocks count one each)."""
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(len(o.param_groups[0]["params"])))
    for s in range(steps):
        _grads(params, s)
        with stepped_in_blocks(opt):
            opt.step()
    return seen


def test_blocks_are_used_where_they_pay():
    """The big parameters are stepped in blocks from the second step on (the first creates the
    state whole); the small one, and optimizers or modes outside the allowlist, never."""
    params = _params()
    n_blocks = sum(-(-p.numel() // _blocked._BLOCK) for p in params[:2])
    assert _group_sizes_seen(torch.optim.AdamW(params, lr=1e-3), params) == [3, n_blocks + 1]
    for kw in (dict(foreach=True), dict(fused=True)):
        assert _group_sizes_seen(torch.optim.AdamW(params, lr=1e-3, **kw), params) == [3, 3], kw

    class MyAdam(torch.optim.Adam):  # a subclass may do anything in its step: left alone
        pass

    assert _group_sizes_seen(MyAdam(params, lr=1e-3), params) == [3, 3]


def test_an_error_in_the_step_restores_the_optimizer():
    params = _params()
    opt = torch.optim.Adam(params, lr=1e-3)
    _grads(params, 0)
    opt.step()
    before = copy.deepcopy(opt.state_dict())

    def boom(o, a, k):
        raise RuntimeError("boom")

    h = opt.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        with stepped_in_blocks(opt):
            opt.step()
    h.remove()
    assert opt.param_groups[0]["params"] == params
    assert len(opt.state) == len(params)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, st in before["state"].items():
        for name, v in st.items():
            assert torch.equal(after["state"][k][name], v)


@pytest.mark.parametrize("optim", [torch.optim.SGD, torch.optim.AdamW])
def test_oss_world1_with_a_large_parameter_equals_the_plain_optimizer(optim):
    """OSS (which steps in blocks) against the plain optimizer (which does not) on a model with a
    large embedding: bit-identical parameters after several steps."""
    kw = dict(lr=0.05, momentum=0.9) if optim is torch.optim.SGD else dict(lr=1e-3)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(40000, 64), torch.nn.Flatten(), torch.nn.Linear(64 * 4, 3))

    ref, ours = model(), model()
    opt_ref = optim(ref.parameters(), **kw)
    opt = OSS(ours.parameters(), optim=optim, **kw)
    assert ours[0].weight.numel() >= _blocked._MIN_ELEMENTS
    for s in range(4):
        x = torch.randint(0, 40000, (8, 4), generator=torch.Generator().manual_seed(s))
        for m, o in ((ref, opt_ref), (ours, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)
