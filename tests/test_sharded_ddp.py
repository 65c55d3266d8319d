"""ShardedDataParallel + OSS against DistributedDataParallel's arithmetic, at world sizes 1, 2 and 4 (CPU).

Every rank trains the wrapped model on its slice of each global batch; the reference is the plain
model and the plain optimizer, computed in one process: the mean over the ranks' slices of the
loss of each slice (what DDP averages), with batch-norm buffers taken from rank 0's slices (what
DDP's buffer broadcast keeps). Tolerances: fp32 atol 1e-5 (the reduction sums in another order);
``reduce_fp16`` 2e-3 (gradients cross the wire in float16, 11 bits of mantissa); bf16 autocast 3e-2.
"""

import copy
import os
import pickle
import time
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import orphaned_segments, run_ranks
from torch import nn

FP32 = dict(atol=1e-5, rtol=1e-5)
FP16_WIRE = dict(atol=2e-3, rtol=2e-3)
BF16 = dict(atol=3e-2, rtol=3e-2)
LOCAL = 4
# Where the scenarios run: "cpu", or "cuda" (rank r on GPU r % count) when the spawning test sets
# FAIRSCALE_C_TEST_DEVICE=cuda (test_sdp_on_cuda below).
DEVICE = {"device": torch.device("cpu")}


class Net(nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.bn = nn.BatchNorm1d(24) if bn else nn.Identity()
        self.fc2 = nn.Linear(24, 32)
        self.fc3 = nn.Linear(32, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(F.gelu(self.fc3(F.relu(self.fc2(F.relu(self.bn(self.fc1(x))))))))


class WideNet(Net):
    """Net's inputs and outputs with layers large enough for the engine's mapped paths: fc2's and
    fc3's weights (512K elements each) are packed into buckets of over 1 MiB, and each rank's
    block of OSS's parameter buffer is about 2 MiB."""

    def __init__(self, bn=False):
        super().__init__(bn)
        self.fc1 = nn.Linear(12, 512)
        self.bn = nn.BatchNorm1d(512) if bn else nn.Identity()
        self.fc2 = nn.Linear(512, 1024)
        self.fc3 = nn.Linear(1024, 512)
        self.head = nn.Linear(512, 3)


def _global_batch(step, world, micro=0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    dev = DEVICE["device"]
    return torch.randn(world * LOCAL, 12, generator=g).to(dev), torch.randn(world * LOCAL, 3, generator=g).to(dev)


def _slice(t, r):
    return t[r * LOCAL : (r + 1) * LOCAL]


def _ref_backward(ref, world, x, y, scale, autocast):
    """DDP's gradient: the mean over ranks of each slice's gradient; buffers as rank 0 leaves them."""
    total = 0.0
    kept = None
    for r in range(world):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = ref(_slice(x, r))
        total = total + F.mse_loss(out.float(), _slice(y, r)) / world * scale
        if r == 0:
            kept = [b.clone() for b in ref.buffers()]
    total.backward()
    with torch.no_grad():
        for b, k in zip(ref.buffers(), kept):
            b.copy_(k)


def _check_grads(sdp, opt, ref, rank, tol):
    """Owners hold the reference gradient, every other rank holds None."""
    for (n, p), q in zip(sdp.module.named_parameters(), ref.parameters()):
        if not p.requires_grad:
            continue
        if opt.param_to_rank[p] == rank:
            assert p.grad is not None, f"{n}: the owner has no gradient"
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=n: f"grad {n}: {m}")
        elif opt.world_size > 1:
            assert p.grad is None, f"{n}: a non-owner kept its gradient"


def _compare(sdp, ref, tol, what):
    sdp.sync_buffers(blocking=True)
    for (n, p), q in zip(sdp.module.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m, n=n: f"{what}: {n}: {m}")


def train(
    rank,
    world,
    optim=torch.optim.SGD,
    okw=None,
    steps=3,
    micro=1,
    accumulate="no_sync",
    bn=False,
    tol=FP32,
    autocast=False,
    clip=None,
    freeze_at=None,
    zero_before_backward=False,
    zero="opt",
    net=Net,
    **sdp_kw,
):
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    okw = okw or dict(lr=0.05, momentum=0.9)
    torch.manual_seed(rank)  # different starting weights: sync_models_at_startup must fix them
    model = net(bn).to(DEVICE["device"])
    torch.manual_seed(0)
    ref = net(bn).to(DEVICE["device"])
    if rank == 0:
        model.load_state_dict(ref.state_dict())
    opt = OSS(model.parameters(), optim=optim, **okw)
    sdp = ShardedDataParallel(model, opt, **sdp_kw)
    ref_opt = optim(ref.parameters(), **okw)
    _compare(sdp, ref, dict(atol=0, rtol=0), "after start-up sync")
    for step in range(steps):
        if freeze_at is not None and step == freeze_at:
            for m in (model, ref):
                m.fc2.requires_grad_(False)
        if freeze_at is not None and step == freeze_at + 2:
            for m in (model, ref):
                m.fc2.requires_grad_(True)
        for j in range(micro):
            x, y = _global_batch(step, world, j)
            last = j == micro - 1
            ctx = sdp.no_sync() if (not last and accumulate == "no_sync") else _Null()
            with ctx:
                with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = sdp(_slice(x, rank))
                if zero_before_backward and j == 0:  # the common `out = model(x); opt.zero_grad()` order
                    opt.zero_grad()
                (F.mse_loss(out.float(), _slice(y, rank)) / micro).backward()
            _ref_backward(ref, world, x, y, 1.0 / micro, autocast)
        _check_grads(sdp, opt, ref, rank, tol)
        if clip is not None:
            norm = opt.clip_grad_norm(clip)
            ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip)
            torch.testing.assert_close(norm, ref_norm, **tol)
        opt.step()
        ref_opt.step()
        if zero == "sdp":  # FairScale's documented loop: the wrapper zeroes the gradients it handed out
            sdp.zero_grad()
        elif not zero_before_backward:
            opt.zero_grad()
        ref_opt.zero_grad()
        _compare(sdp, ref, tol, f"step {step}")
    return sdp, opt


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ------------------------------------------------------------------------------------ scenarios


def scenario_matches_ddp(rank, world):
    train(rank, world)  # default bucket (the whole model in one bucket per owner)
    train(rank, world, optim=torch.optim.Adam, okw=dict(lr=1e-2), reduce_buffer_size=0)  # one reduce per param
    sdp, _ = train(rank, world, optim=torch.optim.AdamW, okw=dict(lr=1e-2), reduce_buffer_size=300, clip=0.3)
    if world > 1:  # several buckets: some were sent while later gradients were still being computed
        assert len(sdp._buckets) > world and sdp._overlapped >= 1, (len(sdp._buckets), sdp._overlapped)
    sdp, _ = train(rank, world, bn=True)  # batch-norm buffers broadcast from rank 0
    train(rank, world, bn=True, broadcast_buffers=False, steps=1)


def scenario_accumulation(rank, world):
    train(rank, world, micro=3, accumulate="no_sync")
    # without no_sync: every backward reduces, and the sum of the reductions is what DDP would give
    train(rank, world, micro=2, accumulate="every_backward", reduce_buffer_size=200)
    train(rank, world, micro=2, accumulate="every_backward", zero_before_backward=True)
    # gradients zeroed by the wrapper: dropped unread when the next one comes (micro=1), copied
    # out of the reused bucket and added back when a second backward accumulates onto them
    train(rank, world, micro=1, steps=4, zero="sdp")
    train(rank, world, micro=2, accumulate="every_backward", zero="sdp")
    train(rank, world, micro=3, accumulate="no_sync", zero="sdp", reduce_buffer_size=200)
    train(rank, world, zero_before_backward=True)


def scenario_in_place_reduction(rank, world):
    """Gradients of at least _DIRECT_MIN elements are averaged in autograd's own tensor, each in
    an operation of its own, instead of being copied into a bucket (the threshold is lowered so
    that fc2's and fc3's weights take that path here)."""
    from fairscale_c.nn.data_parallel import sharded_ddp

    old = sharded_ddp._DIRECT_MIN
    sharded_ddp._DIRECT_MIN = 500
    try:
        sdp, _ = train(rank, world, optim=torch.optim.AdamW, okw=dict(lr=1e-2), clip=0.3)
        if world > 1:
            direct = sorted(b.numel for b in sdp._buckets if b.numel >= 500)
            assert direct == [512, 768], direct
        train(rank, world, micro=3, accumulate="no_sync")
        train(rank, world, micro=2, accumulate="every_backward")
        train(rank, world, zero_before_backward=True)
        train(rank, world, reduce_fp16=True, tol=FP16_WIRE)  # float16 on the wire: bucketed as before
    finally:
        sharded_ddp._DIRECT_MIN = old


def scenario_shared_buffers(rank, world):
    """On CPU, OSS's parameter buffers and ShardedDataParallel's packed gradient buckets live in
    shared tensors, so the buckets' reduces and the parameters' broadcasts copy straight between
    the ranks' memory (each counted in the engine group's mapped_ops); training matches DDP."""
    import fairscale_c.distributed as fdist

    cpu = DEVICE["device"].type == "cpu"
    group = fdist.group_for(dist.group.WORLD)
    shm = getattr(group, "_shm", None)
    before = shm.mapped_ops if shm is not None else 0
    steps = 3
    sdp, opt = train(rank, world, net=WideNet, optim=torch.optim.AdamW, okw=dict(lr=1e-3), steps=steps)
    packed = [b for b in sdp._buckets if b.buffer is not None and len(b.params) > 1]
    want = cpu and world > 1
    # from 1 MiB (where the engine maps a reduce); smaller ones stay ordinary
    shared = [(b.numel, fdist.is_shared(b.buffer)) for b in packed]
    assert shared == [(n, want and n * 4 >= 1 << 20) for n, _ in shared], shared
    assert opt.buckets and all(fdist.is_shared(b.flat) == want for b in opt.buckets)
    if world > 1:  # one rank reduces nothing: no buckets' buffers
        assert packed, [(len(b.params), b.numel) for b in sdp._buckets]
    if want:
        reduces = sum(b.numel * 4 >= 1 << 20 for b in packed)
        broadcasts = sum(n * 4 >= 32 << 10 for b in opt.buckets for n in b.lengths)
        assert reduces >= 1 and broadcasts >= 2, (reduces, broadcasts)  # fc2 and fc3 have their owners
        ran = shm.mapped_ops - before
        assert ran >= steps * (reduces + broadcasts), (ran, steps, reduces, broadcasts)
    # accumulation on shared buckets: gradients handed out as views of a shared buffer are set
    # aside (copied out of it) before the next backward reuses it
    train(rank, world, net=WideNet, micro=2, accumulate="every_backward", zero="sdp", steps=2)
    train(rank, world, net=WideNet, micro=3, accumulate="no_sync", steps=2)


def scenario_reduce_fp16(rank, world):
    for size in (0, 2**23):
        train(rank, world, reduce_fp16=True, reduce_buffer_size=size, tol=FP16_WIRE)


def scenario_autocast(rank, world):
    train(rank, world, autocast=True, tol=BF16, bn=True)


def scenario_trainability_changes(rank, world):
    train(rank, world, steps=5, freeze_at=1)  # frozen at step 1, unfrozen at step 3: picked up by forward


class Gated(nn.Module):
    """A layer used or skipped by the input (data-dependent routing, as in mixture-of-experts)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(12, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, use_b):
        h = F.relu(self.a(x))
        return self.head(self.b(h) if use_b else h)


def scenario_parameter_unused_in_the_last_backward(rank, world):
    """Two micro-batches: the first uses Gated.b on every rank, the last on some ranks only (or
    none). A rank that skips b in the last backward still contributes its gradient from the first:
    accumulated locally under no_sync, or, accumulating without it, the owner's gradient from the
    first reduction stays in the sum. DDP's gradients, as plain torch gives them."""
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    micro = 2
    for accumulate in ("no_sync", "every_backward"):
        for last_uses in (
            [True] * world,
            [False] * world,
            [r == 0 for r in range(world)],
            [r != 0 for r in range(world)],
        ):
            torch.manual_seed(0)
            model = Gated().to(DEVICE["device"])
            ref = copy.deepcopy(model)
            opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
            sdp = ShardedDataParallel(model, opt)
            for step in range(2):
                for j in range(micro):
                    uses = [True] * world if j < micro - 1 else last_uses
                    x, y = _global_batch(step, world, j)
                    ctx = sdp.no_sync() if (j < micro - 1 and accumulate == "no_sync") else _Null()
                    with ctx:
                        (F.mse_loss(sdp(_slice(x, rank), uses[rank]), _slice(y, rank)) / micro).backward()
                    total = sum(F.mse_loss(ref(_slice(x, r), uses[r]), _slice(y, r)) for r in range(world))
                    (total / world / micro).backward()
                what = f"{accumulate}, last micro-batch uses b on {last_uses}, step {step}"
                try:
                    _check_grads(sdp, opt, ref, rank, FP32)
                except AssertionError as e:
                    raise AssertionError(f"{what}: {e}") from None
                opt.step()
                ref_opt.step()
                opt.zero_grad()
                ref_opt.zero_grad()
                _compare(sdp, ref, FP32, what)


def scenario_manual_reduce_and_api(rank, world):
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    assert sdp.fc1 is model.fc1 and sdp.device_type == "cpu"  # attribute forwarding
    x, y = _global_batch(0, world)
    with sdp.no_sync():
        F.mse_loss(sdp(_slice(x, rank)), _slice(y, rank)).backward()
    sdp.reduce()  # reduces what no_sync accumulated
    _ref_backward(ref, world, x, y, 1.0, False)
    _check_grads(sdp, opt, ref, rank, FP32)
    if world > 1:
        with pytest.raises(RuntimeError, match="no gradients are waiting"):
            sdp.reduce()
    else:  # a group of one reduces nothing: the gradients stay as they are
        before = [p.grad.clone() for p in model.parameters()]
        sdp.reduce()
        assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    sdp.zero_grad()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    sdp.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    assert sdp.to(dtype=torch.float64) is sdp and model.fc1.weight.dtype == torch.float64
    out = sdp(_slice(x, rank).double())
    F.mse_loss(out, _slice(y, rank).double()).backward()
    opt.step()
    with pytest.raises(ValueError, match="device type"):
        sdp.to("meta")


def scenario_param_group_added(rank, world):
    """A layer that joins the optimizer mid-training (add_param_group) has its gradient reduced
    from the next forward on."""
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    late = lambda m: list(m.head.parameters())  # noqa: E731
    early = lambda m: [p for p in m.parameters() if all(p is not q for q in late(m))]  # noqa: E731
    opt = OSS(early(model), optim=torch.optim.SGD, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(early(ref), lr=0.05, momentum=0.9)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=100)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": late(model), "lr": 0.1})
            ref_opt.add_param_group({"params": late(ref), "lr": 0.1})
        x, y = _global_batch(step, world)
        F.mse_loss(sdp(_slice(x, rank)), _slice(y, rank)).backward()
        _ref_backward(ref, world, x, y, 1.0, False)
        if step >= 2:
            _check_grads(sdp, opt, ref, rank, FP32)
        opt.step()
        ref_opt.step()
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            for p in late(m):  # the layer's gradients before it joined stay out of the comparison
                p.grad = None
        _compare(sdp, ref, FP32, f"step {step}")


def scenario_grad_scaler_skips_everywhere(rank, world):
    """An inf in one gradient, seen by its owner only: every rank skips the step and backs off."""
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS
    from fairscale_c.optim.grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = Net().to(DEVICE["device"])
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    scaler = ShardedGradScaler(init_scale=1024.0)
    target = model.fc3.weight
    for step in range(2):
        x, y = _global_batch(step, world)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(F.mse_loss(sdp(_slice(x, rank)), _slice(y, rank))).backward()
        overflow = step == 0
        if overflow and opt.param_to_rank[target] == rank:
            target.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert unchanged == overflow, (step, unchanged)
        assert scaler.get_scale() == 512.0, scaler.get_scale()  # backed off once, on every rank
        opt.zero_grad()


def scenario_bad_input(rank, world):
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    model = Net()
    with pytest.raises(TypeError, match="'sharded_optimizer' must be a fairscale_c.optim.OSS"):
        ShardedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="'module' must be a torch.nn.Module"):
        ShardedDataParallel(lambda x: x, OSS(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="reduce_buffer_size"):
        ShardedDataParallel(model, OSS(model.parameters(), lr=0.1), reduce_buffer_size=-1)


def scenario_gradient_that_requires_grad_refused(rank, world):
    """As FairScale, at every world size: a training forward refuses a parameter whose .grad
    requires grad (double backward is not supported); an eval forward runs."""
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    model = Net()
    chained = torch.zeros_like(model.fc1.weight, requires_grad=True)
    model.fc1.weight.grad = chained
    sdp = ShardedDataParallel(model, OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1))
    x = torch.randn(4, 12)
    with pytest.raises(RuntimeError, match="gradients that do not require grad"):
        sdp(x)
    sdp.eval()
    assert sdp(x).shape == (4, 3)


def _small(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(DEVICE["device"])


def _small_batch(step, rank):
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(100 * step + rank)).to(DEVICE["device"])


def scenario_backward_outside_a_training_step(rank, world):
    """A backward after an eval forward (input saliency) or through the inner module accumulates
    locally and is not carried into the next step; torch.autograd.grad on the parameters leaves
    their gradients alone; a hook registered after the wrapper's sees the local gradient;
    half()/double() keep working, and a cast that changes nothing stays local to its rank."""
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    m, ref = _small(), _small()
    opt = OSS(m.parameters(), torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    sdp = ShardedDataParallel(m, opt)
    for step in range(4):
        opt.zero_grad()  # OSS's (torch's): does not know the wrapper
        x = _small_batch(step, rank)
        sdp(x).pow(2).mean().backward()
        owned = {id(p): p.grad.clone() for p in m.parameters() if p.grad is not None}
        torch.autograd.grad(sdp.module(x).sum(), list(m.parameters()))  # a metric: no accumulation
        assert {id(p): p.grad for p in m.parameters() if p.grad is not None}.keys() == owned.keys()
        assert all(torch.equal(p.grad, owned[id(p)]) for p in m.parameters() if p.grad is not None)
        opt.step()
        if step % 2:
            sdp.eval()
            xi = x.clone().requires_grad_()
            sdp(xi).sum().backward()  # gradients for the input; the parameters' accumulate locally
            sdp.train()
        else:
            sdp.module(x).sum().backward()  # around the wrapper, as with ddp.module
        ref_opt.zero_grad()
        xs = [_small_batch(step, r) for r in range(world)]
        (sum(ref(xr).pow(2).mean() for xr in xs) / world).backward()
        ref_opt.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **FP32)

    seen = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(None if p.grad is None else p.grad.clone()))
    opt.zero_grad()
    sdp(_small_batch(9, rank)).pow(2).mean().backward()
    assert len(seen) == 4 and all(g is not None for g in seen), seen
    held = [weakref.ref(p.grad) for p in m.parameters() if p.grad is not None]
    opt.zero_grad(set_to_none=True)
    assert all(g() is None for g in held)  # the wrapper keeps no averaged gradient alive
    if rank == 0:
        sdp.cpu()  # changes nothing: no collective (the other ranks do not call it)
        sdp.float()

    for cast in (sdp.double, sdp.float, lambda: sdp.to(torch.float64), lambda: sdp.to(torch.float32)):
        cast()
        opt.zero_grad()
        x = _small_batch(10, rank).to(next(m.parameters()).dtype)
        sdp(x).sum().backward()
        opt.step()
        assert all(p.dtype == x.dtype for p in m.parameters())

    for obj, name in ((opt, "OSS"), (sdp, "ShardedDataParallel")):  # a copy would not work: said at once
        for copier in (copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=f"{name} cannot be pickled or deep-copied"):
                copier(obj)
    copy.deepcopy(sdp.module)  # what to copy instead (an EMA model, say)
    assert copy.copy(opt).optim is opt.optim and copy.copy(sdp).module is sdp.module  # shallow: allowed

    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="argument 'module' holds Embedding '0' with sparse=True"):
        ShardedDataParallel(sparse, OSS(sparse.parameters(), torch.optim.SGD, lr=0.1))


def scenario_inference_mode_non_contiguous_and_meta_state(rank, world):
    """Forwards under torch.inference_mode() (the first one, and one after a layer was frozen)
    leave the parameters trainable; a non-contiguous buffer is broadcast as DDP broadcasts it; a
    module or optimizer with meta tensors is refused, naming them."""
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    m, ref = _small(), _small()
    transposed = torch.full((4, 3), float(rank + 1), device=DEVICE["device"]).t()
    m.register_buffer("transposed", transposed)
    opt = OSS(m.parameters(), torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    sdp = ShardedDataParallel(m, opt)
    assert torch.equal(m.transposed, torch.ones(3, 4, device=DEVICE["device"])), m.transposed  # rank 0's
    assert m.transposed is transposed and not m.transposed.is_contiguous()
    with torch.inference_mode():
        sdp(_small_batch(0, rank))  # the wrapper's first forward: it builds its buffers here
    for step in range(3):
        if step == 1:
            m[0].requires_grad_(False)
            ref[0].requires_grad_(False)
            with torch.inference_mode():
                sdp.eval()
                sdp(_small_batch(9, rank))  # rebuilds the buffers for the frozen layer
                sdp.train()
            m[0].requires_grad_(True)  # refused on an inference tensor
            ref[0].requires_grad_(True)
        opt.zero_grad()
        sdp(_small_batch(step, rank)).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        xs = [_small_batch(step, r) for r in range(world)]
        (sum(ref(xr).pow(2).mean() for xr in xs) / world).backward()
        ref_opt.step()
    assert not any(p.is_inference() for p in m.parameters())
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **FP32)
    if rank == 0:
        m.transposed.fill_(7.0)
    sdp(_small_batch(5, rank))  # broadcast_buffers: rank 0's buffers before the forward
    assert torch.equal(m.transposed, torch.full((3, 4), 7.0, device=DEVICE["device"])), m.transposed

    meta = _small().to_empty(device="meta")
    on_meta = r"argument 'params' holds parameters on the meta device \(position\(s\) \[0, 1, 2, 3\]\)"
    with pytest.raises(ValueError, match=on_meta):
        OSS(meta.parameters(), torch.optim.SGD, lr=0.1)
    real = _small()
    real.register_buffer("counter", torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match="argument 'module' has buffer 'counter' on the meta device"):
        ShardedDataParallel(real, OSS(real.parameters(), torch.optim.SGD, lr=0.1))


def scenario_frozen_with_a_gradient_left(rank, world):
    """A layer frozen while its gradient is still there (zeroed in place: zero_grad(set_to_none=
    False), the wrapper's default) is not stepped by its owner, with momentum: every rank's copy
    stays as it was when frozen (FairScale's owner steps it and the other ranks never see it)."""
    import torch.distributed as dist

    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    m = _small()
    opt = OSS(m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.1)
    sdp = ShardedDataParallel(m, opt)
    for step in range(5):
        if step == 2:
            m[0].requires_grad_(False)
            frozen = [p.detach().clone() for p in m[0].parameters()]
        sdp(_small_batch(step, rank)).pow(2).mean().backward()
        opt.step()
        sdp.zero_grad()
    for p, f in zip(m[0].parameters(), frozen):
        if opt.param_to_rank[p] == rank:
            assert p.grad is not None  # the owner's (the others' were dropped after the reduction)
        torch.testing.assert_close(p.detach(), f, atol=0, rtol=0)
    for p in m.parameters():
        copies = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(copies, p.detach().contiguous())
        assert all(torch.equal(c, copies[0]) for c in copies)


SCENARIOS = {name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")}
ALL = sorted(SCENARIOS)


def _job(rank, world, names):
    torch.set_num_threads(1)
    if os.environ.get("FAIRSCALE_C_TEST_DEVICE") == "cuda":
        DEVICE["device"] = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE["device"])
    dist.init_process_group("gloo")
    failures = []
    try:
        for name in names:
            try:
                SCENARIOS[name](rank, world)
            except Exception:  # noqa: BLE001 - reported with its traceback
                failures.append(f"[{name}] rank {rank}:\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_ddp_matches_ddp(world):
    before = orphaned_segments()
    results = run_ranks(_job, world, ALL, env={"FAIRSCALE_C_TIMEOUT": "120"}, timeout=300)
    failures = [f for fs in results for f in fs]
    assert not failures, "\n\n".join(failures)
    assert orphaned_segments() <= before


def _failure_job(rank, world):
    """A rank that skips a step, then (in a new group) a rank that dies: DistributedError on the
    others, never a hang. Returns (message of the skipped step, message of the dead peer, seconds)."""
    from fairscale_c import DistributedError
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x, y = _global_batch(0, world)
    model = Net(bn=True)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    skipped = None
    try:
        for step in range(3):
            F.mse_loss(sdp(_slice(x, rank)), _slice(y, rank)).backward()
            if not (rank == 1 and step == 1):
                opt.step()
    except DistributedError as e:
        skipped = str(e)
    pg = dist.new_group(list(range(world)))
    model = Net()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=pg, lr=0.1)
    sdp = ShardedDataParallel(model, opt, process_group=pg)
    F.mse_loss(sdp(_slice(x, rank)), _slice(y, rank)).backward()
    opt.step()
    if rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            F.mse_loss(sdp(_slice(x, rank)), _slice(y, rank)).backward()
            opt.step()
    except DistributedError as e:
        return skipped, str(e), time.monotonic() - t0
    return skipped, None, time.monotonic() - t0


@pytest.mark.serial  # kills a rank; times how soon the peer knows
def test_skipped_step_and_dead_peer_raise_instead_of_hanging():
    before = orphaned_segments()
    results = run_ranks(_failure_job, 2, env={"FAIRSCALE_C_TIMEOUT": "20"}, may_die=[1], timeout=120)
    skipped, dead, seconds = results[0]
    assert skipped and "mismatch" in skipped, skipped
    assert dead and "rank 1" in dead, dead
    assert seconds < 10, seconds
    assert orphaned_segments() <= before


def test_exports():
    import fairscale_c.nn
    import fairscale_c.nn.data_parallel
    from fairscale_c.nn.data_parallel.sharded_ddp import ShardedDataParallel

    assert fairscale_c.nn.ShardedDataParallel is fairscale_c.nn.data_parallel.ShardedDataParallel is ShardedDataParallel


CUDA_SCENARIOS = ["matches_ddp", "accumulation", "reduce_fp16", "grad_scaler_skips_everywhere"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("world", [1, 2])
def test_sdp_on_cuda(world):
    """The numerics scenarios with model, data and reference on the GPU (NCCL underneath)."""
    from test_cuda import _nccl_devices

    env = {"FAIRSCALE_C_TIMEOUT": "120", "FAIRSCALE_C_TEST_DEVICE": "cuda"}
    if world == 2:
        env.update(_nccl_devices()[1])  # skips when two ranks can neither have a GPU each nor share one
    results = run_ranks(_job, world, CUDA_SCENARIOS, env=env, timeout=300)
    failures = [f for fs in results for f in fs]
    assert not failures, "\n\n".join(failures)
