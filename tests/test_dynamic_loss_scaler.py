"""fairscale_c.experimental.optim.DynamicLossScaler: a training loop with injected overflows
follows the scale schedule FairScale's scaler defines (checked against FairScale's own class
when it is importable), skips exactly the overflowing steps, and steps with the unscaled
gradients (once, also after an explicit unscale_); misuse raises."""

import copy
import math

import pytest
import torch

from fairscale_c.experimental.optim import DynamicLossScaler

OVERFLOW_STEPS = {1, 2, 6}


def _train(scaler_cls, steps=10, unscale_first=False, **kwargs):
    """SGD on a small model; at OVERFLOW_STEPS one gradient is set to inf after backward. Returns
    the scale after every update, the steps that moved the parameters, and the final weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = scaler_cls(**kwargs)
    scales, stepped = [], []
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if step in OVERFLOW_STEPS:
            model.weight.grad[0, 0] = math.inf
        if unscale_first and step not in OVERFLOW_STEPS:
            scaler.unscale_(opt)
        before = model.weight.detach().clone()
        if scaler.step(opt) is not None or not torch.equal(before, model.weight):
            stepped.append(step)
        scaler.update()
        scales.append(scaler.loss_scale)
        if step not in OVERFLOW_STEPS:  # the reference steps with the true gradients
            ref_opt.zero_grad()
            ref(x).square().mean().backward()
            ref_opt.step()
    return scales, stepped, model, ref


def test_schedule_skipped_steps_and_unscaled_gradients():
    scales, stepped, model, ref = _train(DynamicLossScaler, init_scale=2.0**10, scale_window=3)
    # every overflow halves the scale (tolerance 0); update() doubles it when the iterations since
    # the last overflow are a multiple of scale_window (an overflowing step counts two iterations,
    # as in FairScale)
    assert scales == [1024.0, 512.0, 256.0, 256.0, 512.0, 512.0, 256.0, 256.0, 512.0, 512.0]
    assert stepped == [s for s in range(10) if s not in OVERFLOW_STEPS]
    assert torch.allclose(model.weight, ref.weight, rtol=1e-6, atol=1e-7)
    # an explicit unscale_ before step (for clipping) is not repeated by step
    _, _, model2, ref2 = _train(DynamicLossScaler, init_scale=2.0**10, scale_window=3, unscale_first=True)
    assert torch.allclose(model2.weight, ref2.weight, rtol=1e-6, atol=1e-7)


def test_schedule_matches_fairscales():
    fs = pytest.importorskip("fairscale.experimental.optim.dynamic_loss_scaler")
    for kwargs in (
        {"init_scale": 2.0**10, "scale_window": 3},
        {"init_scale": 8.0, "scale_window": 2, "tolerance": 0.5},
    ):
        ours = _train(DynamicLossScaler, **kwargs)
        theirs = _train(fs.DynamicLossScaler, **kwargs)
        assert ours[0] == theirs[0] and ours[1] == theirs[1]
        assert torch.allclose(ours[2].weight, theirs[2].weight)


def test_tolerance_threshold_and_minimum():
    scaler = DynamicLossScaler(init_scale=4.0, tolerance=1.0, threshold=None, min_loss_scale=1.0)
    with pytest.raises(OverflowError):
        scaler._check_overflow(math.nan)  # one overflow in one iteration: share 1.0 >= tolerance
    assert scaler.loss_scale == 2.0
    with pytest.raises(FloatingPointError, match="Minimum loss scale reached \\(1.0\\)"):
        scaler._check_overflow(math.inf)
    assert scaler.loss_scale == 2.0  # restored
    floor = DynamicLossScaler(init_scale=4.0, threshold=3.0)
    with pytest.raises(OverflowError):
        floor._check_overflow(math.inf)
    assert floor.loss_scale == 3.0


def test_misuse_raises_and_state_round_trips():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=16.0)
    scaled = scaler.scale([torch.ones(1), torch.ones(2)])
    assert isinstance(scaled, list) and scaled[1].tolist() == [16.0, 16.0]
    scaler.scale(model(torch.ones(3, 2)).sum()).backward()
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    scaler.step(opt)  # a new iteration
    other = DynamicLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.loss_scale == scaler.loss_scale == 16.0
    with pytest.raises(ValueError, match="scale_factor"):
        DynamicLossScaler(scale_factor=1.0)
