"""fairscale_c.experimental.nn.OffloadModel against the plain nn.Sequential: outputs, input and
parameter gradients and three SGD steps equal (bit for bit, with dropout masks repeated) with and
without activation checkpointing, close with micro-batches; integer inputs; pre-sliced lists;
FairScale's slicing rule; eval; bad arguments; on a CUDA device with the host as offload device,
every parameter and gradient is home after each step (GPU-marked)."""

import inspect
import pytest
import torch
from torch import nn

from fairscale_c.experimental.nn import OffloadModel
from fairscale_c.experimental.nn.offload import _split


def _model(dropout=0.3, embed=False):
    torch.manual_seed(0)
    first = [nn.Embedding(20, 8)] if embed else [nn.Linear(8, 8)]
    return nn.Sequential(
        *first,
        nn.Linear(8, 16),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(16, 16),
        nn.Dropout(dropout),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def _train(model, x, steps=3, seed=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for step in range(steps):
        torch.manual_seed(seed + step)
        opt.zero_grad()
        inp = x.clone().requires_grad_() if x.is_floating_point() else x
        y = model(inp)
        y.square().sum().backward()
        outs.append((y.detach(), None if not x.is_floating_point() else inp.grad))
        opt.step()
    return outs


@pytest.mark.parametrize("checkpoint,micro,dropout", [(False, 1, 0.3), (True, 1, 0.3), (True, 2, 0.0), (True, 3, 0.0)])
@pytest.mark.parametrize("slices", [1, 3, 10])
def test_trains_like_the_plain_model(checkpoint, micro, dropout, slices):
    x = torch.randn(12, 8)
    ref, wrapped = _model(dropout), _model(dropout)
    om = OffloadModel(
        wrapped, torch.device("cpu"), num_slices=slices, checkpoint_activation=checkpoint, num_microbatches=micro
    )
    assert len(om.model_slices) == min(slices, len(wrapped))
    exact = micro == 1  # micro-batches sum the parameter gradients in another order
    for (y1, g1), (y2, g2) in zip(_train(ref, x), _train(om, x)):
        assert torch.equal(y1, y2) if exact else torch.allclose(y1, y2, atol=1e-6)
        assert torch.equal(g1, g2) if exact else torch.allclose(g1, g2, atol=1e-6)
    for p, q in zip(ref.parameters(), om.parameters()):
        assert torch.equal(p, q) if exact else torch.allclose(p, q, atol=1e-6)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_integer_inputs(checkpoint):
    ids = torch.randint(0, 20, (6, 3))
    ref = _model(0.0, embed=True)
    om = OffloadModel(_model(0.0, embed=True), torch.device("cpu"), num_slices=2, checkpoint_activation=checkpoint)
    for (y1, _), (y2, _) in zip(_train(ref, ids), _train(om, ids)):
        assert torch.equal(y1, y2)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), om.parameters()))


def test_a_list_is_taken_as_slices():
    ref = _model(0.0)
    pieces = [nn.Sequential(*list(_model(0.0))[:3]), nn.Sequential(*list(_model(0.0))[3:])]
    om = OffloadModel(pieces, torch.device("cpu"))
    assert len(om.model_slices) == 2 and om.model_slices[1].model_shard is pieces[1]
    x = torch.randn(4, 8)
    assert torch.equal(om(x), ref(x))


def test_slicing_follows_fairscales_rule():
    layers = [nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 30), nn.ReLU(), nn.Linear(30, 1)]
    # 110, 0, 110, 330, 0, 31 parameters; 581 // 3 = 193 per slice
    groups = _split(layers, 3)
    assert [len(g) for g in groups] == [2, 1, 3]
    assert [len(g) for g in _split(layers[:2], 5)] == [1, 1]  # never more slices than modules


def test_eval_and_no_grad():
    om = OffloadModel(_model(), torch.device("cpu"), num_slices=3)
    om.eval()
    ref = _model().eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert torch.equal(om(x), ref(x))  # dropout off in every slice
    assert not any(m.training for m in om.modules())


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(model=nn.Linear(2, 2)), TypeError, "argument 'model' must be an nn.Sequential or a list"),
        (dict(model=[]), TypeError, "must hold at least one nn.Module"),
        (dict(device=None), TypeError, "argument 'device' must be a torch.device"),
        (dict(num_slices=0), ValueError, "argument 'num_slices' must be an int >= 1"),
        (dict(num_microbatches=2), RuntimeError, "only support microbatches with activation checkpointing"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    args = dict(model=_model(), device=torch.device("cpu"))
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        OffloadModel(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("checkpoint,micro", [(False, 1), (True, 1), (True, 2)])
def test_on_cuda_parameters_stay_home_between_steps(checkpoint, micro):
    x = torch.randn(12, 8)
    ref = _model(0.0).cuda()
    om = OffloadModel(
        _model(0.0), torch.device("cuda"), num_slices=3, checkpoint_activation=checkpoint, num_microbatches=micro
    )
    assert all(p.device.type == "cpu" and p.is_pinned() for p in om.parameters())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(om.parameters(), lr=0.1)  # steps the parameters at home, on the host
    for _ in range(3):
        for model, o, inp in ((ref, opt_ref, x.cuda()), (om, opt, x)):
            o.zero_grad()
            y = model(inp)
            assert y.device.type == "cuda"
            y.square().sum().backward()
            o.step()
        assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in om.parameters())
    for p, q in zip(ref.parameters(), om.parameters()):
        assert torch.allclose(p.cpu(), q, atol=1e-5)


def test_checkpointed_slices_replay_the_forwards_autocast():
    x = torch.randn(12, 8)
    ref = _model(0.0)
    om = OffloadModel(_model(0.0), torch.device("cpu"), num_slices=3, checkpoint_activation=True)
    results = []
    for model in (ref, om):
        inp = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(inp)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        results.append((y.detach(), inp.grad, [p.grad for p in model.parameters()]))
    (y1, g1, p1), (y2, g2, p2) = results
    assert torch.equal(y1, y2) and torch.equal(g1, g2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def test_model_shard_moves_take_non_blocking_as_in_fairscale():
    from fairscale_c.experimental.nn.offload import ModelShard

    for name in ("forward_load", "backward_load", "forward_drop", "backward_drop"):
        params = inspect.signature(getattr(ModelShard, name)).parameters
        assert list(params) == ["self", "non_blocking"] and params["non_blocking"].default is True, name
