"""fairscale_c.optim.layerwise_gradient_scaler.LayerwiseGradientScaler: with power-of-two scales a
training run is bit-identical to the same run without scaling; each listed layer's parameter
gradients are scaled by its own factor between scale() and unscale(); an overflow in one layer
skips the step and backs off that layer's scale only, and the next step uses true gradients
(where FairScale's class steps with the overflowed layer's gradients still scaled); the scale
schedule, state_dict and misuse."""

import copy
import math

import pytest
import torch
import torch.nn as nn

from fairscale_c.optim.layerwise_gradient_scaler import LayerwiseGradientScaler

SCALES = {"fc1": 1024.0, "fc2": 512.0, "fc3": 2.0**20}


class FeedForward(nn.Module):
    """A chain of modules in named_modules() order, ending in Identity (scale 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.fc1 = nn.Linear(3, 16)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(16, 16)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(16, 1)
        self.sigmoid = nn.Sigmoid()
        self.identity = nn.Identity()

    def forward(self, x):
        for m in (self.fc1, self.relu1, self.fc2, self.relu2, self.fc3, self.sigmoid, self.identity):
            x = m(x)
        return x


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 3, generator=g), torch.randint(0, 2, (32,), generator=g).float()


def _train(scaler_cls, layer_scale_dict, steps=4, inject=None, **kwargs):
    """SGD with momentum; ``inject`` maps a step to a layer whose weight gradient is made inf
    after backward. Returns the model, the scaler and the steps that moved the parameters."""
    model = FeedForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = scaler_cls(model, layer_scale_dict, **kwargs)
    moved = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        scaler.scale()
        nn.functional.binary_cross_entropy(model(x).squeeze(1), y).backward()
        if inject and step in inject:
            getattr(model, inject[step]).weight.grad[0, 0] = math.inf
        scaler.unscale()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        if any(not torch.equal(b, p) for b, p in zip(before, model.parameters())):
            moved.append(step)
    return model, scaler, moved


def _reference(steps, skip=()):
    model = FeedForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        if step in skip:
            continue
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.binary_cross_entropy(model(x).squeeze(1), y).backward()
        opt.step()
    return model


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_power_of_two_scales_train_bit_identically():
    model, scaler, moved = _train(LayerwiseGradientScaler, SCALES)
    assert moved == [0, 1, 2, 3]
    _assert_same(model, _reference(4))
    assert [i.scaling_factor for i in scaler.get_layer_info()] == [1024.0, 1.0, 512.0, 1.0, 2.0**20, 1.0, 1.0]
    assert all(len(h[0]) == 0 for _, h in scaler.get_backward_hooks())  # unscale() removed them


def test_each_layer_gradient_carries_its_own_scale():
    model = FeedForward()
    ref = copy.deepcopy(model)
    scaler = LayerwiseGradientScaler(model, SCALES)
    x, y = _batch(0)
    scaler.scale()
    assert all(len(h[0]) == 1 for _, h in scaler.get_backward_hooks())
    nn.functional.binary_cross_entropy(model(x).squeeze(1), y).backward()
    nn.functional.binary_cross_entropy(ref(x).squeeze(1), y).backward()
    for name in ("fc1", "fc2", "fc3"):
        for p, q in zip(getattr(model, name).parameters(), getattr(ref, name).parameters()):
            assert torch.equal(p.grad, q.grad * SCALES[name]), name
    scaler.unscale()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_overflow_skips_the_step_and_backs_off_that_layer_only():
    model, scaler, moved = _train(LayerwiseGradientScaler, SCALES, steps=5, inject={1: "fc2"}, growth_interval=3)
    assert moved == [0, 2, 3, 4]
    # the step after the overflow uses true gradients for every layer (fc2's included)
    _assert_same(model, _reference(5, skip={1}))
    info = {i.layer_name: i for i in scaler.get_layer_info()}
    # fc2 backed off at step 1 and grew back after 3 clean steps (2, 3, 4); fc1 and fc3 grew after
    # steps 0-2 (the overflow in fc2 does not reset their trackers)
    assert info["fc2"].scaling_factor == 512.0 and info["fc2"].growth_tracker == 0
    assert info["fc1"].scaling_factor == 2048.0 and info["fc1"].growth_tracker == 2
    assert info["fc3"].scaling_factor == 2.0**21 and info["fc3"].growth_tracker == 2
    assert info["relu1"].scaling_factor == 1.0 and info["relu1"].growth_tracker == 5


def test_fairscales_class_steps_with_scaled_gradients_after_an_overflow():
    fs = pytest.importorskip("fairscale.optim.layerwise_gradient_scaler")
    ours, _, _ = _train(LayerwiseGradientScaler, SCALES, steps=3, inject={1: "fc2"})
    theirs, _, moved = _train(fs.LayerwiseGradientScaler, SCALES, steps=3, inject={1: "fc2"})
    ref = _reference(3, skip={1})
    _assert_same(ours, ref)
    assert moved == [0, 2]
    # FairScale's unscale() at step 2 reads step 1's flags and leaves fc2's gradient times 256
    assert not torch.equal(theirs.fc2.weight, ref.fc2.weight)


def test_matches_fairscales_class_without_overflow():
    fs = pytest.importorskip("fairscale.optim.layerwise_gradient_scaler")
    ours, s1, _ = _train(LayerwiseGradientScaler, SCALES, steps=6, growth_interval=2)
    theirs, s2, _ = _train(fs.LayerwiseGradientScaler, SCALES, steps=6, growth_interval=2)
    _assert_same(ours, theirs)
    assert [i.scaling_factor for i in s1.get_layer_info()] == [i.scaling_factor for i in s2.get_layer_info()]


def test_scale_is_clamped():
    _, scaler, _ = _train(
        LayerwiseGradientScaler, {"fc1": 4.0}, steps=3, inject={0: "fc1", 1: "fc1"}, min_scale=2.0, growth_interval=1
    )
    fc1 = scaler.get_layer_info()[0]
    assert fc1.scaling_factor == 4.0  # 4 -> 2 -> 2 (min) -> 4
    _, scaler, _ = _train(LayerwiseGradientScaler, {"fc1": 4.0}, steps=3, max_scale=8.0, growth_interval=1)
    assert scaler.get_layer_info()[0].scaling_factor == 8.0


def test_scale_twice_keeps_one_set_of_hooks_and_step_unscales():
    model = FeedForward()
    ref = _reference(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = LayerwiseGradientScaler(model, SCALES)
    scaler.scale()
    scaler.scale()
    x, y = _batch(0)
    nn.functional.binary_cross_entropy(model(x).squeeze(1), y).backward()
    scaler.step(opt)  # no unscale(): step does it
    _assert_same(model, ref)
    assert all(len(h[0]) == 0 for _, h in scaler.get_backward_hooks())


def test_empty_dict_only_steps():
    model = FeedForward()
    scaler = LayerwiseGradientScaler(model, {}, growth_factor=0.5)  # factors unchecked, as in FairScale
    scaler.scale()
    assert scaler.get_layer_info() == [] and all(len(h[0]) == 0 for _, h in scaler.get_backward_hooks())
    model(torch.ones(2, 3)).sum().backward()
    scaler.unscale()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.fc1.weight.detach().clone()
    scaler.step(opt)
    assert not torch.equal(before, model.fc1.weight)


def test_state_dict_round_trip():
    _, scaler, _ = _train(LayerwiseGradientScaler, SCALES, steps=3, inject={1: "fc2"}, growth_interval=2)
    state = scaler.state_dict()
    fresh = LayerwiseGradientScaler(FeedForward(), SCALES, growth_interval=2)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert state["scaling_factor"]["fc2"] == 256.0 and state["growth_tracker"]["fc2"] == 1
    with pytest.raises(ValueError, match="'state_dict' holds 'scaling_factor' for modules"):
        LayerwiseGradientScaler(nn.Sequential(nn.Linear(2, 2)), {"0": 2.0}).load_state_dict(state)
    bad = copy.deepcopy(state)
    bad["scaling_factor"]["fc1"] = -1.0
    with pytest.raises(ValueError, match="maps 'fc1' to -1.0; expected a finite number > 0"):
        fresh.load_state_dict(bad)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"model": "net"}, TypeError, "argument 'model' must be a torch.nn.Module"),
        ({"layer_scale_dict": [("fc1", 2.0)]}, TypeError, "argument 'layer_scale_dict' must be a dict"),
        ({"layer_scale_dict": {"fc9": 2.0}}, ValueError, r"names no module of the model: \['fc9'\]"),
        ({"layer_scale_dict": {"fc1": 0.0}}, ValueError, "maps 'fc1' to 0.0; expected a finite number > 0"),
        ({"layer_scale_dict": {"fc1": math.inf}}, ValueError, "maps 'fc1' to inf"),
        ({"growth_factor": 1.0}, AssertionError, "argument 'growth_factor' must be > 1.0"),
        ({"backoff_factor": 1.5}, AssertionError, "argument 'backoff_factor' must be < 1.0"),
        ({"growth_interval": 0}, ValueError, "argument 'growth_interval' must be an int >= 1"),
        ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "argument 'min_scale'"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    args = {"model": FeedForward(), "layer_scale_dict": {"fc1": 2.0}, **kwargs}
    with pytest.raises(exc, match=match):
        LayerwiseGradientScaler(**args)


def test_unscale_without_scale_raises():
    scaler = LayerwiseGradientScaler(FeedForward(), SCALES)
    with pytest.raises(RuntimeError, match=r"unscale\(\) called without a scale\(\)"):
        scaler.unscale()
