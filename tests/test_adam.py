"""fairscale_c.optim.Adam (fairscale.optim.Adam): the C kernel equals, bit for bit, the same update
written as float32 torch ops (every precision mode, both eps placements, with and without bias
correction and weight decay, float16 state with its scale); with eps = 0 and no weight decay it
trains like torch.optim.Adam; PURE_FP16's scale halves and the state is zeroed on an overflow,
and grows back; state dicts round-trip exactly (master weights included); bad input raises; the
CUDA kernel equals the CPU one (GPU-marked)."""

import copy
import math

import pytest
import torch

from fairscale_c import _C
from fairscale_c.optim import Adam, Precision


def _ref_update(p, g, m, v, step, lr, betas, eps, wd, bias_correction=True, inside=False, optim_scale=1.0):
    """FairScale's kernel as float32 torch ops, one rounding per operation. Returns the new
    (param, exp_avg, exp_avg_sq) in their dtypes, and whether float16 state overflowed."""
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    # a correctly rounded float32 square root (torch's vectorised one may be 1 ulp off)
    sqrt = lambda x: torch.sqrt(x.double()).float()  # noqa: E731
    b1, b2 = f(betas[0]), f(betas[1])
    omb1, omb2 = f(1.0) - b1, f(1.0) - b2
    if bias_correction:  # float32 corrections from a double pow of the float32 betas
        bc1, bc2 = f(1.0 - float(b1) ** step), f(1.0 - float(b2) ** step)
        step_size = f(lr) * sqrt(bc2) / bc1
    else:
        step_size = f(lr)
    scaled = m.dtype == torch.float16
    P, G, M, V = p.float(), g.float() / f(1.0), m.float(), v.float()
    if scaled:
        M, V = M / f(optim_scale), V / f(optim_scale)
    mom = b1 * M + omb1 * G
    vel = b2 * V + omb2 * G * G
    if scaled:
        m_new, v_new = (mom * f(optim_scale)).half(), (vel * f(optim_scale)).half()
        overflow = not (bool(m_new.isfinite().all()) and bool(v_new.isfinite().all()))
    else:
        m_new, v_new, overflow = mom.to(m.dtype), vel.to(v.dtype), False
    denom = sqrt(vel + f(eps)) if inside else sqrt(vel) + f(eps)
    update = mom / denom + f(wd) * P
    return (P - step_size * update).to(p.dtype), m_new, v_new, overflow


def _data(n, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


def _kernel(p, g, m, v, copy=None, **hp):
    flag = torch.zeros(1)
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, bias_correction=True)
    args.update(eps_inside_sqrt=False, grad_scale=1.0, optim_scale=1.0)
    args.update(hp)
    _C.cpu_fs_adam_step(p, g, m, v, copy, flag, **args)
    return bool(flag.item())


@pytest.mark.parametrize(
    "pdt,gdt,sdt",
    [
        (torch.float32, torch.float32, torch.float32),  # FULL_PRECISION
        (torch.float32, torch.float16, torch.float32),  # MIXED_PRECISION's master step
        (torch.float16, torch.float16, torch.float32),  # MEMORY_EFFICIENT_MIXED_PRECISION
        (torch.bfloat16, torch.bfloat16, torch.float32),
        (torch.float16, torch.float16, torch.float16),  # PURE_FP16
    ],
)
@pytest.mark.parametrize("inside,bias_correction,wd", [(False, True, 0.0), (True, True, 0.01), (False, False, 0.1)])
def test_kernel_equals_the_update_written_as_float32_ops(pdt, gdt, sdt, inside, bias_correction, wd):
    n = 1003
    p, g = _data(n, pdt, 1), _data(n, gdt, 2)
    m, v = _data(n, sdt, 3, 0.1), _data(n, torch.float32, 4, 0.1).abs().to(sdt)
    os_ = 4096.0 if sdt == torch.float16 else 1.0
    hp = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, wd=wd, bias_correction=bias_correction, inside=inside)
    for step in (1, 2, 7):
        want = _ref_update(p, g, m, v, step, optim_scale=os_, **hp)
        copy_out = torch.empty(n, dtype=torch.float16) if pdt == torch.float32 and gdt == torch.float16 else None
        got = [t.clone() for t in (p, m, v)]
        overflow = _kernel(
            got[0], g, got[1], got[2], copy_out, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=wd,
            step=step, bias_correction=bias_correction, eps_inside_sqrt=inside, optim_scale=os_,
        )  # fmt: skip
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want[:3]):
            assert a.dtype == b.dtype and torch.equal(a, b), f"step {step}: {name} differs"
        assert overflow == want[3] is False
        if copy_out is not None:
            assert torch.equal(copy_out, got[0].half())


def test_float16_state_overflow_is_reported():
    p, g = _data(64, torch.float16, 1), _data(64, torch.float16, 2, 100.0)
    m, v = torch.zeros(64, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)
    want = _ref_update(p, g, m, v, 1, 1e-3, (0.9, 0.999), 1e-8, 0.0, optim_scale=65536.0)
    assert want[3]  # 0.1 * |g| * 2**16 is past float16's range for most elements
    got = [t.clone() for t in (p, m, v)]
    assert _kernel(got[0], g, got[1], got[2], optim_scale=65536.0)
    for a, b in zip(got, want[:3]):
        assert torch.equal(a, b)


# (param, grad, state dtype, with a half copy): the precision modes' combinations
_DTYPE_CASES = [
    (torch.float32, torch.float32, torch.float32, False),  # FULL_PRECISION
    (torch.float32, torch.float16, torch.float32, True),  # MIXED_PRECISION's master step
    (torch.float16, torch.float16, torch.float32, False),  # MEMORY_EFFICIENT_MIXED_PRECISION
    (torch.bfloat16, torch.bfloat16, torch.float32, False),
    (torch.float16, torch.float16, torch.float16, False),  # PURE_FP16
]
_HP = dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.01, bias_correction=True)
_HP.update(eps_inside_sqrt=False, grad_scale=1.0)


def _multi_case(pdt, gdt, sdt, with_copy, sizes):
    """Per parameter (param, grad, exp_avg, exp_avg_sq, copy or None), of the given sizes."""
    out = []
    for i, n in enumerate(sizes):
        m, v = _data(n, sdt, 10 * i + 3, 0.1), _data(n, torch.float32, 10 * i + 4, 0.1).abs().to(sdt)
        copy_ = torch.empty(n, dtype=torch.float16) if with_copy else None
        out.append([_data(n, pdt, 10 * i + 1), _data(n, gdt, 10 * i + 2, 100.0 if i == 1 else 1.0), m, v, copy_])
    return out


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    "pdt,gdt,sdt,with_copy",
    _DTYPE_CASES,
)
def test_multi_parameter_step_equals_one_step_per_parameter(pdt, gdt, sdt, with_copy, threads):
    """cpu_fs_adam_multi (Adam.step's path) gives the bits of cpu_fs_adam_step on each parameter,
    with each parameter's own step count, also split over threads (sizes that do not divide into
    the pieces, a parameter with no elements, one that overflows float16 state)."""
    sizes = [300_001, 5, 0, 1 << 18, 77_777]
    steps = [1, 4, 2, 3, 9]
    os_ = 4096.0 if sdt == torch.float16 else 1.0
    one, multi = _multi_case(pdt, gdt, sdt, with_copy, sizes), _multi_case(pdt, gdt, sdt, with_copy, sizes)
    flag_one = torch.zeros(1)
    for (p, g, m, v, c), step in zip(one, steps):
        _C.cpu_fs_adam_step(p, g, m, v, c, flag_one, step=step, optim_scale=os_, **_HP)
    flag_multi = torch.zeros(1)
    lists = list(zip(*multi))
    _C.cpu_fs_adam_multi(
        list(lists[0]), list(lists[1]), list(lists[2]), list(lists[3]), list(lists[4]) if with_copy else None,
        steps, flag_multi, optim_scale=os_, threads=threads, **_HP,
    )  # fmt: skip
    for i, (a, b) in enumerate(zip(one, multi)):
        for name, x, y in zip(("param", "grad", "exp_avg", "exp_avg_sq", "copy"), a, b):
            assert x is None and y is None or torch.equal(x, y), f"parameter {i}: {name} differs"
    assert torch.equal(flag_one, flag_multi)
    assert bool(flag_multi) == (sdt == torch.float16)  # the second parameter's large gradient


def test_multi_parameter_step_bad_input_changes_nothing():
    ps, gs = [torch.zeros(4), torch.zeros(3)], [torch.ones(4), torch.ones(4)]
    ms, vs = [torch.zeros(4), torch.zeros(3)], [torch.zeros(4), torch.zeros(3)]
    flag = torch.zeros(1)
    hp = dict(optim_scale=1.0, **_HP)
    with pytest.raises(ValueError, match="grad has 4 elements, param has 3"):
        _C.cpu_fs_adam_multi(ps, gs, ms, vs, None, [1, 1], flag, **hp)
    assert torch.equal(ps[0], torch.zeros(4)) and torch.equal(ms[0], torch.zeros(4))  # checked before stepping
    with pytest.raises(ValueError, match="argument 'steps': 1 entries, expected 2"):
        _C.cpu_fs_adam_multi(ps, gs, ms, vs, None, [1], flag, **hp)
    with pytest.raises(ValueError, match="argument 'grads': 1 entries, expected 2"):
        _C.cpu_fs_adam_multi(ps, gs[:1], ms, vs, None, [1, 1], flag, **hp)
    with pytest.raises(TypeError, match="argument 'params': expected a list of tensors"):
        _C.cpu_fs_adam_multi(3, gs, ms, vs, None, [1, 1], flag, **hp)
    with pytest.raises(TypeError, match="argument 'steps': entry 1 is not an int"):
        _C.cpu_fs_adam_multi(ps[:1] * 2, gs, ms[:1] * 2, vs[:1] * 2, None, [1, 1.5], flag, **hp)
    with pytest.raises(ValueError, match="step must be >= 1, got 0"):
        _C.cpu_fs_adam_multi(ps[:1] * 2, gs, ms[:1] * 2, vs[:1] * 2, None, [1, 0], flag, **hp)
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        _C.cpu_fs_adam_multi(ps[:1], gs[:1], ms[:1], vs[:1], None, [1], flag, threads=0, **hp)


def _model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)
    return model


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    return (model(x.to(next(model.parameters()).dtype)).float() - y).pow(2).mean()


def _train(model, opt, steps):
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


@pytest.mark.parametrize(
    "precision,dtype",
    [
        (Precision.FULL_PRECISION, torch.float32),
        (Precision.MIXED_PRECISION, torch.float16),
        (Precision.MIXED_PRECISION, torch.bfloat16),
        (Precision.MEMORY_EFFICIENT_MIXED_PRECISION, torch.float16),
        (Precision.PURE_FP16, torch.float16),
    ],
)
def test_training_steps_follow_the_reference_bit_for_bit(precision, dtype):
    model = _model(dtype)
    ref = copy.deepcopy(model)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    opt = Adam(model.parameters(), precision=precision, **hp)
    state_dtype = torch.float16 if precision is Precision.PURE_FP16 else torch.float32
    masters = [p.detach().float() for p in ref.parameters()]
    moments = [(torch.zeros_like(p, dtype=state_dtype), torch.zeros_like(p, dtype=state_dtype)) for p in masters]
    for step in range(5):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        ref.zero_grad()
        _loss(ref, step).backward()
        for i, p in enumerate(ref.parameters()):
            base = masters[i] if precision is Precision.MIXED_PRECISION else p.detach()
            new_p, m, v, _ = _ref_update(
                base, p.grad, *moments[i], step + 1, hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"],
                optim_scale=opt._optim_scale,
            )  # fmt: skip
            moments[i] = (m, v)
            if precision is Precision.MIXED_PRECISION:
                masters[i] = new_p
                new_p = new_p.to(dtype)
            with torch.no_grad():
                p.copy_(new_p)
    assert opt._optim_scale == (2.0**16 if precision is Precision.PURE_FP16 else 1.0)
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        assert p.dtype == dtype and torch.equal(p, q), i
        assert opt.state[p]["exp_avg"].dtype == state_dtype
        assert torch.equal(opt.state[p]["exp_avg"], moments[i][0])
        assert torch.equal(opt.state[p]["exp_avg_sq"], moments[i][1])
        if precision is Precision.MIXED_PRECISION:
            assert torch.equal(opt.fp32_param_groups[0]["params"][i], masters[i])


def test_without_eps_and_weight_decay_it_trains_like_torch_adam():
    model, ref = _model(torch.float32), _model(torch.float32)
    _train(model, Adam(model.parameters(), lr=1e-2, eps=0.0), 10)
    _train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2, eps=0.0), 10)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_precision_is_inferred_as_fairscale_does():
    assert Adam(_model(torch.float32).parameters()).precision is Precision.FULL_PRECISION
    opt = Adam(_model(torch.float16).parameters())
    assert opt.precision is Precision.MIXED_PRECISION and opt.mixed_precision
    assert len(opt.fp32_param_groups) == 1 and all(p.dtype == torch.float32 for p in opt.fp32_param_groups[0]["params"])
    assert opt.supports_memory_efficient_fp16 and not opt._step_supports_amp_scaling
    repr(opt)


def test_pure_fp16_scale_backs_off_and_grows_back():
    model = _model(torch.float16)
    opt = Adam(model.parameters(), lr=1e-3, precision=Precision.PURE_FP16)
    opt.zero_grad()
    (_loss(model, 0) * 1e4).backward()  # large gradients: the scaled first moment overflows float16
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt._optim_scale == 2.0**15 and opt._steps_since_optim_scale_change == 0
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # the update stays
    for p in model.parameters():
        assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()  # zeroed
    opt._optim_scale_update_freq = 1  # as FairScale's test_update_optim_scale
    _train(model, opt, 1)
    assert opt._optim_scale == 2.0**16
    _train(model, opt, 1)
    assert opt._optim_scale == 2.0**16  # never above 2**16


def test_pure_fp16_scale_below_one_raises():
    weight = torch.nn.Parameter(torch.tensor([[float("inf")]]).half())
    opt = Adam([weight], lr=1e-3, precision=Precision.PURE_FP16)
    opt._optim_scale = 1.0
    weight.float().mv(torch.ones(1)).pow(2).sum().backward()  # FairScale's test: an inf gradient
    with pytest.raises(RuntimeError, match="Optimizer state scale < 1"):
        opt.step()


@pytest.mark.parametrize(
    "precision,dtype",
    [
        (Precision.FULL_PRECISION, torch.float32),
        (Precision.MIXED_PRECISION, torch.float16),
        (Precision.MEMORY_EFFICIENT_MIXED_PRECISION, torch.float16),
        (Precision.PURE_FP16, torch.float16),
    ],
)
def test_state_dict_round_trip_continues_identically(precision, dtype):
    """FairScale's state_dict_test: after loading, both optimizers take the same steps. Here it
    holds in every mode (FairScale's fails for the two mixed modes: its loader rounds the moments
    through float16, and its state dict lacks the master weights)."""
    model = _model(dtype)
    opt = Adam(model.parameters(), lr=1e-2, precision=precision)
    _train(model, opt, 5)
    clone = copy.deepcopy(model)
    opt_c = Adam(clone.parameters(), lr=1e-2, precision=precision)
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], opt_c.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt_c.state[q]["exp_avg_sq"])
    for step in range(5, 10):
        for m, o in ((model, opt), (clone, opt_c)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
        for p, q in zip(model.parameters(), clone.parameters()):
            assert torch.equal(p, q), step


def test_several_groups_and_non_contiguous_parameters():
    conv = torch.nn.Conv2d(3, 4, 3).half()
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    ref.weight.data = ref.weight.data.contiguous()
    opts = [
        Adam([{"params": [m.weight]}, {"params": [m.bias], "lr": 1e-1}], lr=1e-2, precision=Precision.MIXED_PRECISION)
        for m in (conv, ref)
    ]
    x = torch.randn(2, 3, 6, 6).half()
    for m, o in zip((conv, ref), opts):
        for _ in range(3):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(conv.weight, ref.weight) and torch.equal(conv.bias, ref.bias)
    assert len(opts[0].fp32_param_groups) == 2


def test_importable_as_fairscale_optim_adam():
    import fairscale_c.optim.adam as mod

    assert mod.Adam is Adam and mod.Precision is Precision


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(amsgrad=True), RuntimeError, "does not support the AMSGrad variant"),
        (dict(lr=-1.0), ValueError, "argument 'lr' must be >= 0"),
        (dict(betas=(0.9, 1.0)), ValueError, r"argument 'betas\[1\]' must be in \[0, 1\)"),
        (dict(betas=0.9), TypeError, "argument 'betas' must be a pair"),
        (dict(eps=math.nan), TypeError, "argument 'eps' must be a finite number"),
        (dict(weight_decay=-0.1), ValueError, "argument 'weight_decay' must be >= 0"),
        (dict(precision="pure_fp16"), TypeError, "argument 'precision' must be a Precision"),
        (dict(precision=Precision.MIXED_PRECISION), TypeError, "precision=MIXED_PRECISION takes"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Adam(_model(torch.float32).parameters(), **kwargs)


def test_bad_parameters_and_state():
    with pytest.raises(ValueError, match="argument 'params' is empty"):
        Adam([])
    with pytest.raises(TypeError, match="precision=PURE_FP16 takes torch.float16 parameters, got torch.bfloat16"):
        Adam(_model(torch.bfloat16).parameters(), precision=Precision.PURE_FP16)
    with pytest.raises(ValueError, match="lacks 'optim_scale'"):
        Adam(_model(torch.float32).parameters()).load_state_dict(
            torch.optim.Adam(_model(torch.float32).parameters()).state_dict()
        )
    f32 = torch.zeros(4)
    with pytest.raises(ValueError, match="cpu_fs_adam_step: exp_avg has 3 elements, param has 4"):
        _kernel(f32.clone(), f32, torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError, match="exp_avg is float32 and exp_avg_sq float16"):
        _kernel(f32.clone(), f32, torch.zeros(4), torch.zeros(4, dtype=torch.float16))
    with pytest.raises(TypeError, match="exp_avg has unsupported dtype bfloat16"):
        _kernel(f32.clone(), f32, torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fs_adam_step: step must be >= 1"):
        _kernel(f32.clone(), f32, torch.zeros(4), torch.zeros(4), step=0)
    with pytest.raises(ValueError, match="optim_scale must be finite and > 0"):
        _kernel(f32.clone(), f32, torch.zeros(4), torch.zeros(4), optim_scale=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "pdt,gdt,sdt,with_copy",
    _DTYPE_CASES,
)
def test_cuda_kernel_equals_the_cpu_kernel(pdt, gdt, sdt, with_copy):
    if not _C.gpu_info()["kernels_built"]:
        pytest.skip("built without CUDA kernels")
    n = 100_003
    p, g = _data(n, pdt, 1), _data(n, gdt, 2, 30.0)  # large enough to overflow some float16 state
    m, v = _data(n, sdt, 3, 0.1), _data(n, torch.float32, 4, 0.1).abs().to(sdt)
    hp = dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.01, step=3, bias_correction=True)
    hp.update(eps_inside_sqrt=False, grad_scale=1.0, optim_scale=1024.0 if sdt == torch.float16 else 1.0)
    cpu = [t.clone() for t in (p, m, v)]
    cpu_copy = torch.empty(n, dtype=torch.float16) if with_copy else None
    cpu_flag = torch.zeros(1)
    _C.cpu_fs_adam_step(cpu[0], g, cpu[1], cpu[2], cpu_copy, cpu_flag, **hp)
    dev = [t.cuda() for t in (p, m, v)]
    dev_copy = torch.empty(n, dtype=torch.float16, device="cuda") if with_copy else None
    dev_flag = torch.zeros(1, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    _C.cuda_fs_adam_step(dev[0], g.cuda(), dev[1], dev[2], dev_copy, dev_flag, **hp, stream=stream)
    torch.cuda.synchronize()
    for a, b in zip(cpu, dev):
        assert torch.equal(a, b.cpu())
    assert torch.equal(cpu_flag, dev_flag.cpu())
    if with_copy:
        assert torch.equal(cpu_copy, dev_copy.cpu())
    # and the optimizer's step on CUDA parameters equals the same on CPU ones, given one gradient
    params = [torch.nn.Parameter(_data(257, torch.float16, 10 + i)) for i in range(2)]
    cuda_params = [torch.nn.Parameter(p.detach().cuda()) for p in params]
    opts = [Adam(ps, lr=1e-2, precision=Precision.PURE_FP16) for ps in (params, cuda_params)]
    for step in range(3):
        for ps, o in zip((params, cuda_params), opts):
            for i, p in enumerate(ps):
                p.grad = _data(257, torch.float16, 100 * step + i, 10.0).to(p.device)
            o.step()
    for p, q in zip(params, cuda_params):
        assert torch.equal(p, q.cpu())
    assert opts[0]._optim_scale == opts[1]._optim_scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pdt,gdt,sdt,with_copy", _DTYPE_CASES)
def test_cuda_multi_parameter_step_equals_the_cpu_one(pdt, gdt, sdt, with_copy):
    """cuda_fs_adam_multi (tables of up to 24 parameters per launch, one block per 4096-element
    chunk) gives the bits of cpu_fs_adam_multi over 30 parameters of uneven sizes, empty ones
    and each parameter's own step count included."""
    if not _C.gpu_info()["kernels_built"]:
        pytest.skip("built without CUDA kernels")
    sizes = [(i * 7919) % 20_000 for i in range(30)] + [4096, 4097, 1]
    steps = [1 + i % 5 for i in range(len(sizes))]
    os_ = 1024.0 if sdt == torch.float16 else 1.0
    cpu = _multi_case(pdt, gdt, sdt, with_copy, sizes)
    dev = [[None if t is None else t.cuda() for t in row] for row in cpu]
    flags = [torch.zeros(1), torch.zeros(1, device="cuda")]
    for rows, flag, fn, extra in (
        (cpu, flags[0], _C.cpu_fs_adam_multi, {}),
        (dev, flags[1], _C.cuda_fs_adam_multi, {"stream": torch.cuda.current_stream().cuda_stream}),
    ):
        lists = [list(c) for c in zip(*rows)]
        fn(*lists[:4], lists[4] if with_copy else None, steps, flag, optim_scale=os_, **_HP, **extra)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(cpu, dev)):
        for name, x, y in zip(("param", "grad", "exp_avg", "exp_avg_sq", "copy"), a, b):
            assert x is None and y is None or torch.equal(x, y.cpu()), f"parameter {i}: {name} differs"
    assert torch.equal(flags[0], flags[1].cpu())


def test_groups_given_as_generators_and_groups_added_later():
    model = _model(torch.float16)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    opt = Adam([{"params": (p for p in layers[0].parameters())}], lr=1e-2)  # a generator
    assert opt.precision is Precision.MIXED_PRECISION and len(opt.param_groups[0]["params"]) == 2
    opt.add_param_group({"params": layers[1].parameters(), "lr": 1e-3})
    assert len(opt.fp32_param_groups) == 2 and len(opt.fp32_param_groups[1]["params"]) == 2
    before = layers[1].weight.detach().clone()
    _loss(model, 0).backward()
    opt.step()
    assert not torch.equal(before, layers[1].weight)
    assert torch.equal(opt.fp32_param_groups[1]["params"][0].half(), layers[1].weight.detach())


def test_pure_fp16_state_reset_keeps_channels_last_parameters_steppable():
    """The moments an overflow zeroes are contiguous again, as the kernel takes them, also for a
    channels_last parameter."""
    conv = torch.nn.Conv2d(3, 4, 3).half()
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    opt = Adam(conv.parameters(), lr=1e-3, precision=Precision.PURE_FP16)
    for scale in (1e4, 1e-3):  # the first step overflows the scaled moments, the second steps normally
        opt.zero_grad()
        (conv(torch.randn(2, 3, 6, 6).half()).float().sum() * scale).backward()
        opt.step()
    assert opt._optim_scale == 2.0**15
    assert opt.state[conv.weight]["exp_avg"].is_contiguous() and opt.state[conv.weight]["exp_avg"].any()
