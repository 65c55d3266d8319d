"""fairscale_c.nn.FlattenParamsWrapper against the unwrapped module: outputs, gradients and
optimizer steps; groups, names and shared parameters; state dicts both ways; unflatten_params;
copies; argument errors."""

import copy
import pickle

import pytest
import torch
from torch import nn

from fairscale_c.nn import FlattenParamsWrapper
from fairscale_c.nn.misc import FlatParameter


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 16)), nn.Linear(16, 3))


class _Tied(nn.Module):
    """_net plus a head that shares _net's last weight."""

    def __init__(self, seed=0):
        super().__init__()
        self.net = _net(seed)
        self.extra = nn.Linear(16, 3)
        self.extra.weight = self.net[1].weight

    def forward(self, x):
        return self.extra(self.net[0](x)) + self.net(x)


def _train(model, forward, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs = []
    for step in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        out = forward(model, x)
        out.pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("groups", ["all", "one list", "two groups", "partial"])
def test_training_matches_the_plain_module(groups):
    plain = _net()
    module = _net()
    param_list = {
        "all": None,
        "one list": list(module.parameters()),
        "two groups": [list(module[0].parameters()), list(module[1].parameters())],
        "partial": list(module[1].parameters()),
    }[groups]
    wrapped = FlattenParamsWrapper(module, param_list)
    flats = {"all": 1, "one list": 1, "two groups": 2, "partial": 1}[groups]
    assert len(wrapped.flat_params) == flats
    assert sum(p.numel() for p in wrapped.parameters()) == sum(p.numel() for p in plain.parameters())
    assert len(list(wrapped.parameters())) == flats + (4 if groups == "partial" else 0)
    ref = _train(plain, lambda m, x: m(x))
    got = _train(wrapped, lambda m, x: m(x))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, wrapped.state_dict()[k]), k


def test_shared_parameter_is_stored_once():
    plain, module = _Tied(), _Tied()
    wrapped = FlattenParamsWrapper(module)
    assert wrapped.flat_param.numel() == sum(p.numel() for p in plain.parameters())  # the tie counted once
    assert module.extra.weight is module.net[1].weight
    for a, b in zip(_train(plain, lambda m, x: m(x)), _train(wrapped, lambda m, x: m(x))):
        assert torch.allclose(a, b, rtol=1.3e-6, atol=1e-5)
    names, shapes, numels = wrapped.metadata(0)
    assert len(names) == len(list(plain.parameters())) and sum(numels) == wrapped.flat_param.numel()
    state = wrapped.state_dict()
    assert state.keys() == plain.state_dict().keys()  # the tied name too, as in the plain module


def test_state_dicts_both_ways():
    source = FlattenParamsWrapper(_net(1))
    target = FlattenParamsWrapper(_net(2))
    x = torch.randn(3, 4)
    target.load_state_dict(source.state_dict())  # the module's own keys
    assert torch.equal(target(x), source(x))
    flat = FlattenParamsWrapper(_net(3)).flat_state_dict()
    assert list(flat) == ["flat_param_0"]
    target.load_state_dict(flat)
    assert torch.equal(target.flat_param, flat["flat_param_0"])
    target.load_state_dict({"flat_param": flat["flat_param_0"] * 2})  # older single-name key
    assert torch.equal(target.flat_param, flat["flat_param_0"] * 2)
    plain = _net(4)
    target.load_state_dict(plain.state_dict())
    assert torch.equal(target(x), plain(x))
    assert target.is_flattened


def test_named_groups_and_unflatten_with_external_data():
    module = _net()
    wrapped = FlattenParamsWrapper(
        module, [list(module[0].parameters()), list(module[1].parameters())], flat_param_names=["body", "head"]
    )
    assert wrapped.flat_param_names == ["flat_param_body", "flat_param_head"]
    assert [n for n, _ in wrapped.named_parameters()] == ["flat_param_body", "flat_param_head"]
    numbered = _net()  # any names, as FairScale formats them: ints too
    groups = [list(numbered[0].parameters()), list(numbered[1].parameters())]
    assert FlattenParamsWrapper(numbered, groups, flat_param_names=[0, 1]).flat_param_names == [
        "flat_param_0",
        "flat_param_1",
    ]
    x = torch.randn(2, 4)
    before = wrapped(x)
    zeros = [torch.zeros_like(p) for p in wrapped.flat_params]
    with wrapped.unflatten_params(zeros):
        assert not wrapped.is_flattened
        assert all(isinstance(p, nn.Parameter) and p.abs().sum() == 0 for p in module.parameters())
        assert torch.equal(module(x), torch.zeros(2, 3))
    assert wrapped.is_flattened and torch.equal(wrapped(x), before)
    with wrapped.unflatten_params():  # views of the flat parameters: changes inside stay
        with torch.no_grad():
            module[1].bias.fill_(7.0)
    assert torch.equal(wrapped.flat_params[1][-3:], torch.full((3,), 7.0))
    assert wrapped[1] is module[1] and wrapped.module is module


def test_copies():
    wrapped = FlattenParamsWrapper(_Tied())
    x = torch.randn(2, 4)
    twin = copy.deepcopy(wrapped)
    assert twin.flat_param.data_ptr() != wrapped.flat_param.data_ptr()
    assert torch.equal(twin(x), wrapped(x))
    assert twin.extra.weight is twin.net[1].weight
    with torch.no_grad():
        twin.flat_param.add_(1.0)
    assert not torch.equal(twin(x), wrapped(x))
    loaded = pickle.loads(pickle.dumps(wrapped))
    assert torch.equal(loaded(x), wrapped(x))
    flat = copy.deepcopy(wrapped.flat_param)
    assert isinstance(flat, FlatParameter) and flat.metadata()[2] == wrapped.flat_param.metadata()[2]


def test_bad_input():
    module = _net()
    with pytest.raises(TypeError, match="argument 'module' must be an nn.Module"):
        FlattenParamsWrapper(lambda x: x)
    with pytest.raises(ValueError, match="puts a parameter in two groups"):
        FlattenParamsWrapper(module, [list(module.parameters()), [module[1].weight]])
    with pytest.raises(ValueError, match="'flat_param_names' has 1 names for 2 groups"):
        m = _net()
        FlattenParamsWrapper(m, [list(m[0].parameters()), list(m[1].parameters())], ["a"])
    with pytest.raises(ValueError, match="unique names"):
        m = _net()
        FlattenParamsWrapper(m, [list(m[0].parameters()), list(m[1].parameters())], ["a", "a"])
    with pytest.raises(ValueError, match="share one dtype and device"):
        m = _net()
        m[1].double()
        FlattenParamsWrapper(m)
    with pytest.raises(ValueError, match="must all require grad, or none"):
        m = _net()
        m[1].bias.requires_grad_(False)
        FlattenParamsWrapper(m)
    with pytest.raises(TypeError, match="argument 'param_list'"):
        FlattenParamsWrapper(_net(), "weights")
    m = _net()
    two = FlattenParamsWrapper(m, [list(m[0].parameters()), list(m[1].parameters())])
    with pytest.raises(RuntimeError, match="there are 2 flat parameters"):
        _ = two.flat_param
    with pytest.raises(ValueError, match="has 3 elements, expected"):
        list(two.flat_params[0].get_param_views(torch.zeros(3)))
    with pytest.raises(ValueError, match="non-empty list"):
        FlatParameter([])
    with pytest.raises(ValueError, match="nesting is not supported"):
        FlatParameter([two.flat_params[0]])


def test_flatten_nothing():
    module = _net()
    wrapped = FlattenParamsWrapper(module, [])
    assert wrapped.flat_params == [] and wrapped.num_params_managed == 0
    x = torch.randn(2, 4)
    assert torch.equal(wrapped(x), module(x))
    assert wrapped.state_dict().keys() == module.state_dict().keys()
