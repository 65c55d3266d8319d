"""fairscale_c.nn.misc ParamBucket and GradBucket: values kept when checked in, tensors that are
views of the buffer (an optimizer step and autograd's accumulation land in it), training equal to
the plain model's, gradients summed across ranks through one collective on the buffer equal to
single-process full-batch gradients, moving and casting, collapse / rebuild / shrink, FairScale's
bookkeeping, and misuse."""

import pytest
import torch
from torch import nn

from fairscale_c.nn.misc import GradBucket, ParamBucket


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(step, rows=8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def _is_view_of(t, buffer):
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    return start <= t.data_ptr() < end


# ------------------------------------------------------------------ ParamBucket


def test_param_bucket_keeps_values_and_makes_views():
    model, ref = _net(), _net()
    bucket = ParamBucket(_numel(model) + 5, torch.float32, "cpu")
    for p in model.parameters():
        bucket.add_param(p)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert _is_view_of(p, bucket.buffer)
    want = torch.cat([q.detach().reshape(-1) for q in ref.parameters()])
    assert torch.equal(bucket.buffer[: want.numel()], want)
    assert torch.equal(bucket.buffer[want.numel() :], torch.zeros(5))
    bucket.buffer.mul_(2)  # a write to the buffer is a write to the parameters
    assert torch.equal(model[0].weight, 2 * ref[0].weight)


def test_training_with_a_param_bucket_equals_the_plain_model():
    model, ref = _net(), _net()
    bucket = ParamBucket(_numel(model), torch.float32, "cpu")
    for p in model.parameters():
        bucket.add_param(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        x, y = _batch(step)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(m, x, y).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    # the optimizer's steps landed in the buffer
    assert torch.equal(bucket.buffer, torch.cat([q.detach().reshape(-1) for q in ref.parameters()]))


def test_param_bucket_cast_and_back_keeps_views_and_values():
    model, ref = _net(), _net()
    bucket = ParamBucket(_numel(model), torch.float32, "cpu")
    for p in model.parameters():
        bucket.add_param(p)
    bucket.to(device="cpu", dtype=torch.float16)
    assert bucket.buffer.dtype == torch.float16
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float16 and _is_view_of(p, bucket.buffer)
        assert torch.equal(p, q.detach().half())
    bucket.to(device="cpu", dtype=torch.float32, keep_param_alignment=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and _is_view_of(p, bucket.buffer)
        assert torch.equal(p, q.detach().half().float())


def test_param_bucket_misuse_raises_naming_the_argument():
    p = torch.rand(20, 30)
    with pytest.raises(AssertionError, match="'param' has 600 elements, the bucket has room for 5"):
        ParamBucket(5, p.dtype, p.device).add_param(p)
    bucket = ParamBucket(300, torch.float32, "cpu")
    q = torch.rand(5, 6)
    bucket.add_param(q)
    with pytest.raises(AssertionError, match="'param' is already in this bucket"):
        bucket.add_param(q)
    with pytest.raises(AssertionError, match="'param' has dtype torch.float64, the bucket holds torch.float32"):
        bucket.add_param(torch.rand(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="'param' must be a Tensor, got list"):
        bucket.add_param([1.0])
    for size in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="'size' must be an int >= 0"):
            ParamBucket(size, torch.float32, "cpu")
    with pytest.raises(AssertionError, match="no parameter has been checked in"):
        ParamBucket(4, torch.float32, "cpu").to("cpu")


# ------------------------------------------------------------------ GradBucket


def _bucketed(model, extra=1, destination=0):
    bucket = GradBucket(_numel(model) + extra, torch.float32, "cpu", destination)
    for p in model.parameters():
        bucket.add_grad(p)
    return bucket


def test_grad_bucket_keeps_existing_gradients_and_zero_fills_missing_ones():
    p, q = torch.rand(2, 3, requires_grad=True), torch.rand(4, requires_grad=True)
    p.grad = torch.rand(2, 3)
    want = p.grad.clone()
    bucket = GradBucket(10, torch.float32, "cpu", -1)
    bucket.add_grad(p)
    bucket.add_grad(q)
    assert torch.equal(p.grad, want) and torch.equal(q.grad, torch.zeros(4))
    assert _is_view_of(p.grad, bucket.buffer) and _is_view_of(q.grad, bucket.buffer)
    assert torch.equal(bucket.buffer, torch.cat([want.reshape(-1), torch.zeros(4)]))


def test_backward_accumulates_into_the_grad_bucket():
    model, ref = _net(), _net()
    bucket = _bucketed(model)
    for step in range(2):  # two backwards: autograd accumulates into the views
        x, y = _batch(step)
        _loss(model, x, y).backward()
        _loss(ref, x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _is_view_of(p.grad, bucket.buffer)
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    flat = torch.cat([q.grad.reshape(-1) for q in ref.parameters()])
    assert torch.allclose(bucket.buffer[: flat.numel()], flat, rtol=1e-6, atol=1e-7)
    bucket.zero()
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_grad_bucket_bookkeeping_as_in_fairscale():
    model = _net()
    bucket = GradBucket(_numel(model), torch.float32, "cpu", destination=1)
    assert bucket.destination == 1 and bucket.sent and bucket.callback is None
    params = list(model.parameters())
    for p in params[:-1]:
        assert bucket.can_add_grad_view(p)
        bucket.add_grad(p)
    assert not bucket.can_add_grad_view(params[0])  # already in
    # the last one would fill the bucket exactly: FairScale's check is strict, add_grad is not
    assert not bucket.can_add_grad_view(params[-1])
    bucket.add_grad(params[-1])
    bucket.reset_checked_in()
    assert not bucket.sent and not bucket.all_checked_in
    bucket.params_checked_in = len(params)
    assert bucket.all_checked_in


def test_collapse_rebuild_and_shrink():
    model, ref = _net(), _net()
    x, y = _batch(0)
    _loss(ref, x, y).backward()
    bucket = _bucketed(model, extra=300)
    _loss(model, x, y).backward()
    bucket.shrink()  # the buffer is reallocated at the gradients' size, values kept
    assert bucket.buffer.numel() == _numel(model)
    assert bucket.buffer.untyped_storage().nbytes() == _numel(model) * 4
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _is_view_of(p.grad, bucket.buffer) and torch.allclose(p.grad, q.grad)
    bucket.collapse()
    assert bucket.buffer.numel() == 0 and all(p.grad is None for p in model.parameters())
    with pytest.raises(AssertionError, match="collapsed; call rebuild"):
        bucket.add_grad(torch.rand(2, requires_grad=True))
    bucket.rebuild()
    assert bucket.buffer.numel() == _numel(model)
    for p in model.parameters():
        assert _is_view_of(p.grad, bucket.buffer) and torch.count_nonzero(p.grad) == 0
    _loss(model, x, y).backward()  # the rebuilt bucket receives gradients again
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad)


def test_grad_bucket_to_rebuilds_a_collapsed_bucket_and_keeps_views():
    model = _net()
    bucket = _bucketed(model)
    bucket.collapse()
    bucket.to("cpu")
    assert bucket.buffer.numel() == _numel(model) + 1
    assert all(_is_view_of(p.grad, bucket.buffer) for p in model.parameters())


def test_grad_bucket_misuse_raises_naming_the_argument():
    p = torch.rand(20, 30, requires_grad=True)
    with pytest.raises(AssertionError, match="'param' has 600 elements, the bucket has room for 5"):
        GradBucket(5, torch.float32, "cpu", -1).add_grad(p)
    bucket = GradBucket(700, torch.float32, "cpu", -1)
    bucket.add_grad(p)
    with pytest.raises(AssertionError, match="'param' is already in this bucket"):
        bucket.add_grad(p)
    with pytest.raises(AssertionError, match="no gradient has been checked in"):
        GradBucket(4, torch.float32, "cpu", 0).rebuild()


# ------------------------------------------------------------------ across ranks


def _world2_grads(rank, world):
    """Each rank: half of the batch; one all_reduce of the bucket sums the gradients."""
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fdist.init_group()
        model = _net()
        bucket = _bucketed(model)
        x, y = _batch(7, rows=8)
        rows = slice(4 * rank, 4 * rank + 4)
        (_loss(model, x[rows], y[rows]) / world).backward()
        fdist.all_reduce(bucket.buffer)
        # numpy arrays: torch's queue pickling would share fds with this exiting process
        return [p.grad.numpy().copy() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


def test_one_all_reduce_of_a_grad_bucket_gives_full_batch_gradients():
    from dist_utils import run_ranks

    results = run_ranks(_world2_grads, 2, timeout=120)
    ref = _net()
    x, y = _batch(7, rows=8)
    _loss(ref, x, y).backward()
    for grads in results:
        for got, q in zip(grads, ref.parameters()):
            assert torch.allclose(torch.from_numpy(got), q.grad, rtol=1e-5, atol=1e-6)
