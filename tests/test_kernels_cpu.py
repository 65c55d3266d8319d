"""CPU reference kernels (csrc/gpu/kernels_cpu.c) against torch on CPU.

These references are what the CPU path runs and what tests/test_cuda.py compares the CUDA
kernels with, so they are held to torch's own results here.
"""

import math

import pytest
import torch

from fairscale_c import _C

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _specials(dtype):
    """Values that exercise rounding, subnormals, overflow and non-finite handling."""
    fi = torch.finfo(dtype)
    vals = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        1 / 3,
        65504.0,
        65519.0,
        65520.0,
        1e-8,
        6e-8,
        3e-5,
        fi.tiny,
        fi.max,
        float("inf"),
        float("-inf"),
        3.3895e38,
        1.0 + 2**-11,
        1.0 + 3 * 2**-11,
        1.0 + 2**-8,
    ]
    return torch.tensor(vals, dtype=torch.float32)


# ---- casts: the CPU reference is fsc_tensor_copy, exposed as _C.copy_ ----------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_f32_to_low_precision_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    src = torch.cat([torch.randn(4096, generator=g) * 1000, torch.randn(4096, generator=g) * 1e-6, _specials(dtype)])
    dst = torch.empty(src.shape, dtype=dtype)
    _C.copy_(dst, src)
    assert torch.equal(dst.view(torch.int16), src.to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_low_precision_to_f32_is_exact(dtype):
    # every bit pattern except NaNs (whose payload torch may canonicalise)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    src = bits.view(dtype)
    src = src[~torch.isnan(src)]
    dst = torch.empty(src.shape, dtype=torch.float32)
    _C.copy_(dst, src)
    assert torch.equal(dst, src.to(torch.float32))


# ---- unscale + inf check ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unscale_finite_scales_and_leaves_flag(dtype):
    g = torch.Generator().manual_seed(1)
    buf = (torch.randn(1000, generator=g) * 64).to(dtype)
    expected = (buf.float() * 0.125).to(dtype)
    found_inf = torch.zeros(1)
    _C.cpu_unscale_inf_check(buf, 0.125, found_inf)
    assert torch.equal(buf, expected)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_sets_flag_on_non_finite(dtype, bad):
    buf = torch.ones(513, dtype=dtype)
    buf[300] = bad
    found_inf = torch.zeros(1)
    _C.cpu_unscale_inf_check(buf, 0.5, found_inf)
    assert found_inf.item() == 1.0
    assert torch.all(buf[:300] == 0.5)


def test_unscale_matches_torch_amp_helper():
    g = torch.Generator().manual_seed(2)
    grads = torch.randn(777, generator=g) * 1e4
    grads[5] = float("nan")
    ours, theirs = grads.clone(), grads.clone()
    found_ours, found_theirs = torch.zeros(1), torch.zeros(1)
    inv = torch.tensor([1 / 1024.0])
    _C.cpu_unscale_inf_check(ours, float(inv), found_ours)
    torch._amp_foreach_non_finite_check_and_unscale_([theirs], found_theirs, inv)
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)
    assert found_ours.item() == found_theirs.item() == 1.0


def test_unscale_flag_is_never_cleared_and_one_is_a_pure_check():
    buf = torch.tensor([1.0, 2.0, 3.0])
    found_inf = torch.ones(1)
    _C.cpu_unscale_inf_check(buf, 1.0, found_inf)
    assert found_inf.item() == 1.0
    assert buf.tolist() == [1.0, 2.0, 3.0]


def test_unscale_rejects_bad_arguments():
    with pytest.raises(TypeError, match="found_inf"):
        _C.cpu_unscale_inf_check(torch.ones(4), 1.0, torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="found_inf must have exactly 1 element"):
        _C.cpu_unscale_inf_check(torch.ones(4), 1.0, torch.zeros(2))
    with pytest.raises(ValueError, match="buf"):
        _C.cpu_unscale_inf_check(torch.ones(4, 4).t(), 1.0, torch.zeros(1))
    with pytest.raises(TypeError, match="buf"):
        _C.cpu_unscale_inf_check(torch.ones(4, dtype=torch.int32), 1.0, torch.zeros(1))


# ---- norms ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_sq_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(10007, generator=g) * 3).to(dtype)
    expected = x.double().pow(2).sum().item()
    assert _C.cpu_sq_norm(x) == pytest.approx(expected, rel=1e-6)
    assert _C.cpu_sq_norm(x, absmax=True) == x.float().abs().max().item()


def test_norm_empty_and_non_finite():
    assert _C.cpu_sq_norm(torch.empty(0)) == 0.0
    assert _C.cpu_sq_norm(torch.empty(0), absmax=True) == 0.0
    x = torch.tensor([1.0, float("nan"), 5.0])
    assert math.isnan(_C.cpu_sq_norm(x))
    assert math.isnan(_C.cpu_sq_norm(x, absmax=True))
    y = torch.tensor([1.0, float("-inf"), 5.0])
    assert _C.cpu_sq_norm(y) == math.inf
    assert _C.cpu_sq_norm(y, absmax=True) == math.inf


def test_norm_is_shape_agnostic():
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    assert _C.cpu_sq_norm(x) == float((x**2).sum())


# ---- AdamW ----------------------------------------------------------------------------------------


def _run_torch_adamw(p0, grads, **hp):
    """torch.optim.AdamW in float64 on the same data: the algorithm without float32 rounding.

    Also returns, per element, the sum of |change| of the parameter over the steps: the size of
    the terms whose float32 roundings accumulate in the result.
    """
    p = torch.nn.Parameter(p0.double())
    opt = torch.optim.AdamW([p], foreach=False, **hp)
    moved = torch.zeros_like(p0, dtype=torch.float64)
    for g in grads:
        before = p.detach().clone()
        p.grad = g.double()
        opt.step()
        moved += (p.detach() - before).abs()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"], moved


def _assert_within(got, want, bound, what):
    err = (got.double() - want).abs()
    worst = int((err / bound).argmax())
    assert bool((err <= bound).all()), (
        f"{what}: {int((err > bound).sum())} of {err.numel()} elements off; worst at {worst}: "
        f"got {got[worst].item()!r}, float64 reference {want[worst].item()!r}, allowed {bound[worst].item():.3g}"
    )


@pytest.mark.parametrize(
    "hp",
    [
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
        dict(lr=0.1, betas=(0.3, 0.5), eps=1e-6, weight_decay=0.0),  # lerp weight >= 0.5 branch
        dict(lr=3e-4, betas=(0.95, 0.99), eps=1e-5, weight_decay=0.1),
    ],
)
def test_adamw_matches_torch_optim(hp):
    """Held to torch's AdamW computed in float64, not to torch's float32 kernels, whose roundings
    differ with the vector instructions ATen picks on the machine (and see
    dist_utils.settle_torch_math)."""
    g = torch.Generator().manual_seed(4)
    n = 4099
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(6)]
    p_ref, m_ref, v_ref, moved = _run_torch_adamw(p0, grads, **hp)

    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, grad in enumerate(grads, start=1):
        _C.cpu_adamw_step(p, grad, m, v, hp["lr"], hp["betas"][0], hp["betas"][1], hp["eps"], hp["weight_decay"], step)
    # Each step rounds a handful of float32 operations (2**-24 relative each) and the hyper-parameters
    # themselves to float32. 1e-6 (about 17 roundings) of the magnitudes that met in the sums: the
    # value itself, the parameter's movement, the gradients averaged into the moments.
    gmax = torch.stack(grads).abs().amax(0).double()
    _assert_within(m, m_ref, 1e-6 * (m_ref.abs() + gmax), "exp_avg")
    _assert_within(v, v_ref, 1e-6 * v_ref, "exp_avg_sq")
    _assert_within(p, p_ref, 1e-6 * (p_ref.abs() + moved), "param")


def test_adamw_rejects_bad_arguments():
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    with pytest.raises(ValueError, match="beta1"):
        _C.cpu_adamw_step(p, g, m, v, 1e-3, 1.0, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="step"):
        _C.cpu_adamw_step(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0)
    with pytest.raises(ValueError, match="lr"):
        _C.cpu_adamw_step(p, g, m, v, -1.0, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="exp_avg_sq has 7 elements"):
        _C.cpu_adamw_step(p, g, m, torch.zeros(7), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match="grad"):
        _C.cpu_adamw_step(p, torch.zeros(8, dtype=torch.float16), m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    assert torch.count_nonzero(p) == 0  # nothing was written by the failed calls
