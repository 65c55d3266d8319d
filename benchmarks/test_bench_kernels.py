"""The C kernels against the torch op chains they replace, on one flat float32 shard.

- cast f32 -> bf16: _C.copy_ (CPU) and _C.cuda_cast against dst.copy_(src);
- unscale + inf check: _C.cpu_unscale_inf_check / _C.cuda_unscale_inf_check against
  torch._amp_foreach_non_finite_check_and_unscale_ (torch.amp.GradScaler's op) and, on CPU, the
  plain chain isfinite().all() + mul_;
- squared 2-norm: _C.cpu_sq_norm / _C.cuda_sq_norm against torch.linalg.vector_norm(x) squared
  (the gradient clips of FSDP and OSS take _C.cpu_sq_norm for host gradients, through
  fairscale_c.internal.params.grad_norm_term);
- AdamW step: _C.cpu_adamw_step / _C.cuda_adamw_step against torch.optim.AdamW(foreach=False)
  .step() (the single-tensor chain the kernel follows op by op) and AdamW(fused=True).

Every case first checks that its implementation computes what the torch one does, then times it.
CPU cases run in this process with one torch thread (the C kernels are single-threaded, and a
rank of a 2-rank job on 2 cores has one core): pytest-benchmark's own calibration and
time.perf_counter. CUDA cases (skipped without a GPU) time CUDA_CALLS launches between two CUDA
events on the current stream, per call (see _harness.measured_time).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch

from _harness import drive, measured_time
from fairscale_c import _C

SIZES: Dict[str, int] = {"64Ki": 1 << 16, "4Mi": 1 << 22}  # elements of the flat shard
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
HAS_CUDA = torch.cuda.is_available()
CUDA_CALLS, CUDA_ROUNDS = 20, 10
# In-process CPU cases: pytest-benchmark calibrates the rounds; cap each case's time.
cpu_case = pytest.mark.benchmark(max_time=0.5, min_rounds=5)


def cuda_case(fn: Callable[..., None]) -> Callable[..., None]:
    """A CUDA case: marked gpu, skipped without a device, timed by CUDA events (measured_time)."""
    fn = pytest.mark.benchmark(timer=measured_time)(fn)
    fn = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")(fn)
    return pytest.mark.gpu(fn)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _data(numel: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(device)


def _label(benchmark: Any, kernel: str, device: str, size: str, impl: str, numel: int) -> None:
    if device == "cuda" and impl == "fairscale_c" and not _C.gpu_info()["kernels_built"]:
        pytest.skip("fairscale_c was built without its CUDA kernels (no nvcc at build time)")
    benchmark.group = f"kernel {kernel} {device} {size}"
    benchmark.extra_info.update(
        {"kernel": kernel, "device": device, "impl": impl, "numel": numel, "torch_threads": torch.get_num_threads()}
    )


def _time_cuda(benchmark: Any, fn: Callable[[], Any]) -> None:
    """CUDA: per round, CUDA_CALLS launches between two events on the current stream; the round's
    per-call time is the events' interval / CUDA_CALLS (launch overhead included, host sync not)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def measure() -> float:
        start.record()
        for _ in range(CUDA_CALLS):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / CUDA_CALLS

    drive(benchmark, measure, CUDA_ROUNDS)
    benchmark.extra_info["calls_per_round"] = CUDA_CALLS


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


# ---------------------------------------------------------------- cast


def _cast(impl: str, device: str, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], Any]:
    if impl == "torch":
        return lambda: dst.copy_(src)
    if device == "cpu":
        return lambda: _C.copy_(dst, src)
    return lambda: _C.cuda_cast(dst, src, _stream())


def _run_cast(benchmark: Any, device: str, size: str, impl: str) -> None:
    numel = SIZES[size]
    _label(benchmark, "cast f32->bf16", device, size, impl, numel)
    src, dst = _data(numel, device), torch.empty(numel, dtype=torch.bfloat16, device=device)
    fn = _cast(impl, device, dst, src)
    fn()
    assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16)), f"{impl} cast differs"
    if device == "cpu":
        benchmark(fn)
    else:
        _time_cuda(benchmark, fn)


@cpu_case
@pytest.mark.parametrize("impl", ["torch", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_cast_cpu(benchmark: Any, size: str, impl: str) -> None:
    _run_cast(benchmark, "cpu", size, impl)


@cuda_case
@pytest.mark.parametrize("impl", ["torch", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_cast_cuda(benchmark: Any, size: str, impl: str) -> None:
    _run_cast(benchmark, "cuda", size, impl)


# ---------------------------------------------------------------- unscale + inf check


def _unscale(impl: str, device: str, buf: torch.Tensor, found: torch.Tensor, inv: float) -> Callable[[], Any]:
    inv_t = torch.full((1,), inv, device=device)
    if impl == "torch_amp":
        return lambda: torch._amp_foreach_non_finite_check_and_unscale_([buf], found, inv_t)
    if impl == "torch_chain":
        return lambda: (found.logical_or_(~torch.isfinite(buf).all()), buf.mul_(inv_t))
    if device == "cpu":
        return lambda: _C.cpu_unscale_inf_check(buf, inv, found)
    return lambda: _C.cuda_unscale_inf_check(buf, inv, found, _stream())


def _run_unscale(benchmark: Any, device: str, size: str, impl: str) -> None:
    numel = SIZES[size]
    _label(benchmark, "unscale+inf check", device, size, impl, numel)
    # Not 1 (the C kernel skips the multiply then), and close to 1 so that the many calls of a
    # case keep the data far from subnormals (slow on x86) and zero (fast).
    inv = 1.0 - 2.0**-20
    buf, found = _data(numel, device) * 65536, torch.zeros(1, device=device)
    expected = buf * inv
    fn = _unscale(impl, device, buf, found, inv)
    fn()
    assert torch.equal(buf, expected) and found.item() == 0.0, f"{impl} unscale differs"
    buf[numel // 2] = float("inf")
    fn()
    assert found.item() != 0.0, f"{impl} missed an inf"
    buf.copy_(expected)
    found.zero_()
    if device == "cpu":
        benchmark(fn)
    else:
        _time_cuda(benchmark, fn)


@cpu_case
@pytest.mark.parametrize("impl", ["torch_amp", "torch_chain", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_unscale_inf_check_cpu(benchmark: Any, size: str, impl: str) -> None:
    _run_unscale(benchmark, "cpu", size, impl)


@cuda_case
@pytest.mark.parametrize("impl", ["torch_amp", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_unscale_inf_check_cuda(benchmark: Any, size: str, impl: str) -> None:
    _run_unscale(benchmark, "cuda", size, impl)


# ---------------------------------------------------------------- squared norm


def _run_sq_norm(benchmark: Any, device: str, size: str, impl: str) -> None:
    numel = SIZES[size]
    _label(benchmark, "squared 2-norm", device, size, impl, numel)
    x = _data(numel, device)
    expected = float(x.double().pow(2).sum())
    if device == "cpu":
        fn = (lambda: float(torch.linalg.vector_norm(x)) ** 2) if impl == "torch" else (lambda: _C.cpu_sq_norm(x))
        # torch accumulates in float32, the C reference in double
        assert fn() == pytest.approx(expected, rel=1e-3 if impl == "torch" else 1e-6), f"{impl} norm differs"
        benchmark(fn)
        return
    out, ws = torch.empty(1, device=device), torch.empty(1024, device=device)
    if impl == "torch":
        fn = lambda: torch.linalg.vector_norm(x).square()  # noqa: E731
        got = float(fn())
    else:
        fn = lambda: _C.cuda_sq_norm(out, x, ws, _stream())  # noqa: E731
        fn()
        got = float(out)
    assert got == pytest.approx(expected, rel=1e-3), f"{impl} norm differs"  # float32 accumulation
    _time_cuda(benchmark, fn)


@cpu_case
@pytest.mark.parametrize("impl", ["torch", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_sq_norm_cpu(benchmark: Any, size: str, impl: str) -> None:
    _run_sq_norm(benchmark, "cpu", size, impl)


@cuda_case
@pytest.mark.parametrize("impl", ["torch", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_sq_norm_cuda(benchmark: Any, size: str, impl: str) -> None:
    _run_sq_norm(benchmark, "cuda", size, impl)


# ---------------------------------------------------------------- AdamW step


class _AdamW:
    """One AdamW step per call on a flat shard: through torch.optim.AdamW (foreach=False: the
    single-tensor op chain; or fused=True) or through the C kernel with the same state."""

    def __init__(self, impl: str, device: str, numel: int) -> None:
        self.impl, self.device = impl, device
        self.param = _data(numel, device, seed=1)
        self.grad = _data(numel, device, seed=2)
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.param), torch.zeros_like(self.param)
        self.step = 0
        if impl.startswith("torch"):
            self.p = torch.nn.Parameter(self.param)
            self.p.grad = self.grad
            fused = impl == "torch_fused"
            self.opt = torch.optim.AdamW([self.p], foreach=False, fused=fused or None, **ADAMW)

    def __call__(self) -> None:
        if self.impl.startswith("torch"):
            self.opt.step()
            return
        self.step += 1
        b1, b2 = ADAMW["betas"]
        args = (ADAMW["lr"], b1, b2, ADAMW["eps"], ADAMW["weight_decay"], self.step)
        if self.device == "cpu":
            _C.cpu_adamw_step(self.param, self.grad, self.exp_avg, self.exp_avg_sq, *args)
        else:
            _C.cuda_adamw_step(self.param, self.grad, self.exp_avg, self.exp_avg_sq, *args, _stream())


def _run_adamw(benchmark: Any, device: str, size: str, impl: str) -> None:
    numel = SIZES[size]
    _label(benchmark, "AdamW step", device, size, impl, numel)
    fn = _AdamW(impl, device, numel)
    ref = _AdamW("torch", device, numel)
    for _ in range(2):
        fn()
        ref()
    torch.testing.assert_close(fn.param, ref.param, rtol=1e-5, atol=1e-6, msg=lambda m: f"{impl} AdamW differs: {m}")
    del ref
    if device == "cpu":
        benchmark(fn)
    else:
        _time_cuda(benchmark, fn)
    assert math.isfinite(float(fn.param.abs().max())), f"{impl} AdamW produced non-finite parameters"


@cpu_case
@pytest.mark.parametrize("impl", ["torch", "torch_fused", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_adamw_step_cpu(benchmark: Any, size: str, impl: str) -> None:
    _run_adamw(benchmark, "cpu", size, impl)


@cuda_case
@pytest.mark.parametrize("impl", ["torch", "torch_fused", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_adamw_step_cuda(benchmark: Any, size: str, impl: str) -> None:
    _run_adamw(benchmark, "cuda", size, impl)


# ---------------------------------------------------------------- FairScale's Adam step


class _FsAdam:
    """One step per call of fairscale_c.optim.Adam (FULL_PRECISION: the C kernel) or of
    torch.optim.Adam (foreach=False, or fused=True) on a flat parameter. With eps = 0 and no
    weight decay the two updates are the same arithmetic (FairScale's eps placement differs)."""

    def __init__(self, impl: str, device: str, numel: int) -> None:
        from fairscale_c.optim import Adam

        self.impl = impl
        self.p = torch.nn.Parameter(_data(numel, device, seed=1))
        self.p.grad = _data(numel, device, seed=2)
        if impl == "fairscale_c":
            self.opt = Adam([self.p], lr=1e-3, eps=0.0)
        else:
            self.opt = torch.optim.Adam([self.p], lr=1e-3, eps=0.0, foreach=False, fused=impl == "torch_fused" or None)

    def __call__(self) -> None:
        self.opt.step()


def _run_fs_adam(benchmark: Any, device: str, size: str, impl: str) -> None:
    numel = SIZES[size]
    _label(benchmark, "Adam step (fairscale.optim.Adam)", device, size, impl, numel)
    fn = _FsAdam(impl, device, numel)
    ref = _FsAdam("torch", device, numel)
    for _ in range(2):
        fn()
        ref()
    torch.testing.assert_close(fn.p, ref.p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{impl} Adam differs: {m}")
    del ref
    if device == "cpu":
        benchmark(fn)
    else:
        _time_cuda(benchmark, fn)
    assert math.isfinite(float(fn.p.detach().abs().max())), f"{impl} Adam produced non-finite parameters"


@cpu_case
@pytest.mark.parametrize("impl", ["torch", "torch_fused", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_fs_adam_step_cpu(benchmark: Any, size: str, impl: str) -> None:
    _run_fs_adam(benchmark, "cpu", size, impl)


@cuda_case
@pytest.mark.parametrize("impl", ["torch", "torch_fused", "fairscale_c"])
@pytest.mark.parametrize("size", list(SIZES))
def test_fs_adam_step_cuda(benchmark: Any, size: str, impl: str) -> None:
    _run_fs_adam(benchmark, "cuda", size, impl)


# A model's parameters rather than one flat shard: the per-parameter cost of a step, and (on the
# CPU) the threads torch's fused step uses, which the C step splits its work over as well.
MODELS: Dict[str, List[int]] = {"200x16Ki": [1 << 14] * 200, "16x1Mi": [1 << 20] * 16}


class _FsAdamModel:
    """One step per call over many parameters: fairscale_c.optim.Adam, or torch.optim.Adam
    single-tensor ("torch"), multi-tensor ("torch_foreach", torch's default) or fused."""

    def __init__(self, impl: str, device: str, sizes: List[int]) -> None:
        from fairscale_c.optim import Adam

        self.params = [torch.nn.Parameter(_data(n, device, seed=i)) for i, n in enumerate(sizes)]
        for i, p in enumerate(self.params):
            p.grad = _data(p.numel(), device, seed=1000 + i)
        if impl == "fairscale_c":
            self.opt: torch.optim.Optimizer = Adam(self.params, lr=1e-3, eps=0.0)
        else:
            self.opt = torch.optim.Adam(
                self.params, lr=1e-3, eps=0.0, foreach=impl == "torch_foreach", fused=impl == "torch_fused" or None
            )

    def __call__(self) -> None:
        self.opt.step()


def _run_fs_adam_model(benchmark: Any, device: str, model: str, impl: str, label: str = "") -> None:
    sizes = MODELS[model]
    _label(benchmark, "Adam step over a model (fairscale.optim.Adam)", device, model + label, impl, sum(sizes))
    fn, ref = _FsAdamModel(impl, device, sizes), _FsAdamModel("torch_fused", device, sizes)
    for _ in range(2):
        fn()
        ref()
    for a, b in zip(fn.params, ref.params):
        # equal_nan: eps = 0 makes 0 / 0 of a zero gradient (one in millions of normal samples)
        torch.testing.assert_close(
            a, b, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{impl} Adam differs: {m}"
        )
    del ref
    if device == "cpu":
        benchmark(fn)
    else:
        _time_cuda(benchmark, fn)


@cpu_case
@pytest.mark.parametrize("impl", ["torch", "torch_foreach", "torch_fused", "fairscale_c"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("threads", ["1", "all"])
def test_fs_adam_model_cpu(benchmark: Any, threads: str, model: str, impl: str) -> None:
    torch.set_num_threads(1 if threads == "1" else os.cpu_count() or 1)
    try:
        benchmark.extra_info["torch_threads"] = torch.get_num_threads()
        _run_fs_adam_model(benchmark, "cpu", model, impl, f", {torch.get_num_threads()} thread(s)")
    finally:
        torch.set_num_threads(1)


@cuda_case
@pytest.mark.parametrize("impl", ["torch", "torch_foreach", "torch_fused", "fairscale_c"])
@pytest.mark.parametrize("model", list(MODELS))
def test_fs_adam_model_cuda(benchmark: Any, model: str, impl: str) -> None:
    _run_fs_adam_model(benchmark, "cuda", model, impl)
