"""fairscale_c.experimental.nn.SyncBatchNorm against plain torch: every rank holds a slice of one
batch (uneven slices, an empty one too), and the outputs, input gradients, summed weight and bias
gradients and running statistics after two steps equal those of one torch BatchNorm over the whole
batch in one process; under checkpoint_wrapper the running statistics move once per step; eval
mode, no torch.distributed, convert_sync_batchnorm and bad input."""

import copy

import pytest
import torch

from dist_utils import clean_dev_shm, join_gloo, not_close, run_ranks  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_dev_shm")

# (shape of the whole batch, rows each rank holds at world 2 / 3 / 4)
CASES = [
    ((12, 3, 4, 5), {2: [7, 5], 3: [5, 0, 7], 4: [3, 3, 3, 3]}),
    ((10, 6), {2: [4, 6], 3: [2, 3, 5], 4: [1, 2, 3, 4]}),
]
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10), torch.bfloat16: (2e-2, 2e-2)}


def _batch(shape, dtype, step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 5  # a large mean: the variance must not cancel
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(dtype), dy.to(dtype)


def _reference(shape, dtype, momentum):
    """Two steps of torch's BatchNorm over the whole batch (float64 math for bfloat16 input)."""
    bn = torch.nn.BatchNorm2d(shape[1], momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 1.5, shape[1]))
        bn.bias.copy_(torch.linspace(-1, 1, shape[1]))
    steps = []
    for step in range(2):
        x, dy = _batch(shape, dtype, step)
        x = x.double().requires_grad_()
        bn.weight.grad = bn.bias.grad = None
        # BatchNorm2d refuses 2-D input; a (N, C) batch is (N, C, 1, 1) to it
        y = bn(x.view(*shape, *([1] * (4 - len(shape))))).view(shape)
        y.backward(dy.double())
        steps.append((y.detach(), x.grad, bn.weight.grad.clone(), bn.bias.grad.clone()))
    return steps, bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)


def _job(rank, world, dtype, momentum, device="cpu"):
    import torch.distributed as dist

    from fairscale_c.experimental.nn import SyncBatchNorm

    join_gloo(rank, world, device)
    failures = []
    try:
        for shape, rows in CASES:
            start = sum(rows[world][:rank])
            mine = slice(start, start + rows[world][rank])
            steps, run_mean, run_var, tracked = _reference(shape, dtype, momentum)
            bn = SyncBatchNorm(shape[1], momentum=momentum)
            with torch.no_grad():
                bn.weight.copy_(torch.linspace(0.5, 1.5, shape[1]))
                bn.bias.copy_(torch.linspace(-1, 1, shape[1]))
            bn = bn.to(device, dtype)
            rtol, atol = TOL[dtype]
            for step, (y_ref, dx_ref, dw_ref, db_ref) in enumerate(steps):
                x, dy = _batch(shape, dtype, step)
                x = x[mine].to(device).requires_grad_()
                bn.zero_grad()
                y = bn(x)
                y.backward(dy[mine].to(device))
                y, dx = y.cpu(), x.grad.cpu()
                grads = torch.cat([bn.weight.grad, bn.bias.grad]).double().cpu()
                dist.all_reduce(grads)  # local parameter gradients: their sum is the whole batch's
                for what, got, whole, want in [
                    ("output", y, y_ref, y_ref[mine]),
                    ("input grad", dx, dx_ref, dx_ref[mine]),
                    ("weight+bias grads", grads, None, torch.cat([dw_ref, db_ref])),
                ]:
                    scale = max(1.0, float((want if whole is None else whole).abs().max()))
                    if msg := not_close(got.double(), want, rtol=rtol, atol=atol * 10 * scale):
                        failures.append(f"{list(shape)} {dtype} step {step} {what}: {msg}")
            for what, got, want in [
                ("running_mean", bn.running_mean, run_mean),
                ("running_var", bn.running_var, run_var),
            ]:
                if msg := not_close(got.double().cpu(), want, rtol=rtol, atol=atol * 10):
                    failures.append(f"{list(shape)} {dtype} {what}: {msg}")
            if int(bn.num_batches_tracked) != tracked:
                failures.append(f"num_batches_tracked {int(bn.num_batches_tracked)}, torch's {tracked}")
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sync_batchnorm_equals_batchnorm_over_the_whole_batch(world):
    assert run_ranks(_job, world, torch.float32, 0.1, timeout=240) == [[]] * world


@pytest.mark.parametrize("dtype,momentum", [(torch.float64, None), (torch.bfloat16, 0.3)])
def test_sync_batchnorm_other_dtypes_and_momentum(dtype, momentum):
    assert run_ranks(_job, 2, dtype, momentum, timeout=240) == [[]] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sync_batchnorm_on_cuda_ranks_equals_batchnorm_over_the_whole_batch():
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    assert run_ranks(_job, 2, torch.float32, 0.1, "cuda", env=nccl_env, timeout=240) == [[]] * 2


def _checkpoint_job(rank, world):
    """Conv + SyncBatchNorm + ReLU with and without checkpoint_wrapper: same outputs and gradients,
    and the running statistics move once per step in both."""
    import torch.distributed as dist

    from fairscale_c.experimental.nn import SyncBatchNorm
    from fairscale_c.nn.checkpoint import checkpoint_wrapper

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = []
        for wrap in (False, True):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), SyncBatchNorm(4), torch.nn.ReLU())
            if wrap:
                net = checkpoint_wrapper(net)
            for step in range(2):
                x = torch.randn(2 + rank, 3, 6, 6, generator=torch.Generator().manual_seed(step * 10 + rank))
                net.zero_grad()
                net(x).square().sum().backward()
            bn = net[1]
            results.append(
                {
                    "grad": net[0].weight.grad.clone(),
                    "mean": bn.running_mean.clone(),
                    "var": bn.running_var.clone(),
                    "tracked": int(bn.num_batches_tracked),
                    "left": len(bn.saved_for_2nd_fwd),
                }
            )
        plain, wrapped = results
        return {
            "tracked": (plain["tracked"], wrapped["tracked"]),
            "left": wrapped["left"],
            "diffs": [not_close(wrapped[k], plain[k], rtol=1e-6, atol=1e-6) for k in ("grad", "mean", "var")],
        }
    finally:
        dist.destroy_process_group()


def test_checkpointed_sync_batchnorm_counts_each_batch_once():
    for r in run_ranks(_checkpoint_job, 2, timeout=240):
        assert r == {"tracked": (2, 2), "left": 0, "diffs": ["", "", ""]}


def test_without_torch_distributed_and_in_eval_it_is_a_plain_batchnorm():
    from fairscale_c.experimental.nn import SyncBatchNorm

    torch.manual_seed(0)
    ref = torch.nn.BatchNorm2d(3)
    bn = SyncBatchNorm(3)
    x = torch.randn(4, 3, 2, 2) * 2 + 1
    assert torch.equal(bn(x), ref(x))
    assert torch.equal(bn.running_mean, ref.running_mean) and int(bn.num_batches_tracked) == 1
    bn.eval()
    ref.eval()
    assert torch.equal(bn(x), ref(x))
    flat = torch.randn(5, 3)  # a converted BatchNorm1d: 2-D input, in eval too
    assert torch.allclose(
        bn(flat), torch.nn.functional.batch_norm(flat, ref.running_mean, ref.running_var, ref.weight, ref.bias)
    )


def test_convert_sync_batchnorm_shares_parameters_and_buffers():
    from fairscale_c.experimental.nn import SyncBatchNorm

    net = torch.nn.Sequential(
        torch.nn.Linear(4, 6),
        torch.nn.BatchNorm1d(6, momentum=0.2),
        torch.nn.Sequential(torch.nn.BatchNorm2d(2, affine=False)),
    )
    bn1d, bn2d = net[1], net[2][0]
    out = SyncBatchNorm.convert_sync_batchnorm(net)
    assert out is net
    assert isinstance(net[1], SyncBatchNorm) and isinstance(net[2][0], SyncBatchNorm)
    assert net[1].weight is bn1d.weight and net[1].running_mean is bn1d.running_mean and net[1].momentum == 0.2
    assert net[2][0].weight is None and net[2][0].running_var is bn2d.running_var
    assert isinstance(SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm3d(5)), SyncBatchNorm)


def _bad_input_job(rank, world):
    import torch.distributed as dist

    from fairscale_c.experimental.nn import SyncBatchNorm

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        bn = SyncBatchNorm(3)
        errors = []
        for x in (torch.randn(3), torch.randn(4, 5, 2)):
            try:
                bn(x)
                errors.append("accepted")
            except ValueError as exc:
                errors.append(str(exc))
        y = bn(torch.randn(4, 3, 2) + rank)  # the group still works
        # one value per channel over the whole group (rank 0 one row, rank 1 none): a ValueError on
        # every rank, as BatchNorm over that batch raises, and the running variance untouched
        before = bn.running_var.clone()
        try:
            bn(torch.randn(1 - rank, 3))
            errors.append("accepted")
        except ValueError as exc:
            errors.append(str(exc))
        errors.append(torch.equal(bn.running_var, before))
        # a copy has its own parameters and statistics and works on the same group
        twin = copy.deepcopy(bn)
        twin.weight.data.add_(1)
        z = twin(torch.randn(4, 3, 2) + rank)
        same_group = twin._process_group is bn._process_group
        return errors + [
            y.shape == (4, 3, 2),
            z.shape == (4, 3, 2),
            same_group,
            not torch.equal(twin.weight, bn.weight),
        ]
    finally:
        dist.destroy_process_group()


def test_bad_input_raises_before_anything_is_sent():
    for errors in run_ranks(_bad_input_job, 2, timeout=120):
        assert "2 or more dimensions, got 1D" in errors[0]
        assert "input has 5 channels (dim 1); expected num_features=3" in errors[1]
        assert "expected more than 1 value per channel when training, got 1 over the 2 ranks' batches" in errors[2]
        assert errors[3:] == [True] * 5, errors


def test_c_helpers_agree_with_the_formulas_and_refuse_bad_sizes():
    from fairscale_c import _C

    g = torch.Generator().manual_seed(3)
    c, counts = 4, [5.0, 0.0, 11.0]
    means, vars_ = (
        torch.randn(3, c, generator=g, dtype=torch.float64),
        torch.rand(3, c, generator=g, dtype=torch.float64),
    )
    gathered = torch.cat(
        [torch.cat([means[r], vars_[r], torch.tensor([counts[r]], dtype=torch.float64)]) for r in range(3)]
    )
    out = torch.empty(3 * c + 1, dtype=torch.float64)
    _C.cpu_bn_combine(gathered, 3, 1e-5, out)
    n = torch.tensor(counts, dtype=torch.float64).unsqueeze(1)
    mean = (n * means).sum(0) / n.sum()
    var = (n * (vars_ + (means - mean) ** 2)).sum(0) / n.sum()
    assert torch.allclose(out[:c], mean) and torch.allclose(out[c : 2 * c], var)
    assert torch.allclose(out[2 * c : 3 * c], torch.rsqrt(var + 1e-5)) and out[-1] == 16.0
    sums, weight = torch.randn(2 * c, generator=g, dtype=torch.float64), torch.rand(c, generator=g)
    coeffs = torch.empty(3 * c, dtype=torch.float64)
    _C.cpu_bn_coeffs(sums, 16.0, out[2 * c : 3 * c], weight, coeffs)
    a = out[2 * c : 3 * c] * weight.double()
    assert torch.allclose(coeffs[:c], a)
    assert torch.allclose(coeffs[c : 2 * c], -a * out[2 * c : 3 * c] * sums[c:] / 16.0)
    assert torch.allclose(coeffs[2 * c :], -a * sums[:c] / 16.0)
    with pytest.raises(ValueError, match="expected world=2 rows of 2C \\+ 1"):
        _C.cpu_bn_combine(gathered, 2, 1e-5, out)
    with pytest.raises(TypeError, match="out has unsupported dtype float32"):
        _C.cpu_bn_combine(gathered, 3, 1e-5, out.float())
    with pytest.raises(ValueError, match="expected sums of 2C, out of 3C"):
        _C.cpu_bn_coeffs(sums[:-1], 16.0, out[2 * c : 3 * c], None, coeffs)
