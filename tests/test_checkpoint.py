"""fairscale_c.nn.checkpoint: checkpoint_wrapper against the unwrapped module (gradients, RNG,
kwargs, non-tensor outputs, BatchNorm statistics, autocast), the is_checkpointing /
is_recomputing flags, and that activations are really dropped. FSDP around wrapped blocks is the
'checkpoint_wrapper' scenario in tests/fsdp_scenarios.py (world 1, 2 and 4)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairscale_c.nn import checkpoint_wrapper
from fairscale_c.nn.checkpoint import is_checkpointing, is_recomputing
from fairscale_c.nn.checkpoint.checkpoint_activations import disable_checkpointing


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 32), nn.BatchNorm1d(32), nn.Linear(32, 3)
        self.calls = {"checkpointing": 0, "recomputing": 0, "plain": 0}

    def forward(self, x, scale=1.0, extra=None):
        key = "checkpointing" if is_checkpointing() else "recomputing" if is_recomputing() else "plain"
        self.calls[key] += 1
        h = F.dropout(F.gelu(self.bn(self.fc1(x))), p=0.3, training=self.training)
        out = self.fc2(h) * scale
        if extra is not None:
            out = out + extra
        return out, {"n": x.shape[0]}, None  # non-tensor outputs pass through


def _run(model, x, extra, seed=3):
    torch.manual_seed(seed)
    out, info, none = model(x, scale=2.0, extra=extra)
    (out.pow(2).sum()).backward()
    return out.detach(), info, none


def test_gradients_rng_kwargs_and_outputs_match_the_plain_module():
    torch.manual_seed(0)
    plain = Net()
    wrapped = copy.deepcopy(plain)
    assert checkpoint_wrapper(wrapped) is wrapped  # the same module, as in FairScale
    x = torch.randn(8, 6)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    extras = [torch.randn(8, 3, requires_grad=True) for _ in range(2)]
    extras[1].data.copy_(extras[0].data)
    ref = _run(plain, xs[0], extras[0])
    got = _run(wrapped, xs[1], extras[1])
    assert torch.equal(ref[0], got[0]) and got[1] == {"n": 8} and got[2] is None
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad), n  # dropout masks replayed: gradients identical
    assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(extras[0].grad, extras[1].grad)
    # BatchNorm statistics updated once per forward, as without checkpointing
    assert torch.equal(plain.bn.running_mean, wrapped.bn.running_mean)
    assert plain.bn.num_batches_tracked == wrapped.bn.num_batches_tracked == 1
    assert wrapped.calls == {"checkpointing": 1, "recomputing": 1, "plain": 0}


def test_activations_are_dropped():
    def saved_bytes(model):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        x = torch.randn(64, 6, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)[0]
        out.sum().backward()
        return sum(total)

    torch.manual_seed(0)
    plain = Net()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    assert saved_bytes(wrapped) < saved_bytes(plain) / 4


def test_bypassed_without_grad_and_when_disabled():
    net = checkpoint_wrapper(Net())
    x = torch.randn(4, 6)
    with torch.no_grad():
        net(x)
    with disable_checkpointing():
        net(x)[0].sum().backward()
    assert net.calls == {"checkpointing": 0, "recomputing": 0, "plain": 2}


def test_eval_mode_batchnorm_reads_running_stats_in_both_passes():
    torch.manual_seed(0)
    plain = Net().eval()
    plain.bn.running_mean.uniform_(-1, 1)
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(8, 6)
    _run(plain, x, None)
    _run(wrapped, x, None)
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_autocast_state_is_replayed():
    torch.manual_seed(0)
    plain = Net()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(8, 6)
    for m in (plain, wrapped):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)[0]
        assert out.dtype is torch.bfloat16
        out.float().sum().backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_offload_to_cpu_on_cpu_tensors_changes_nothing():
    torch.manual_seed(0)
    plain = Net()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain), offload_to_cpu=True)
    x = torch.randn(8, 6)
    assert torch.equal(_run(plain, x, None)[0], _run(wrapped, x, None)[0])
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_bad_module_argument():
    with pytest.raises(TypeError, match="argument 'module' must be an nn.Module"):
        checkpoint_wrapper(lambda x: x)


def test_import_paths_mirror_fairscale():
    import fairscale_c.nn
    import fairscale_c.nn.checkpoint
    import fairscale_c.nn.misc

    assert fairscale_c.nn.checkpoint_wrapper is fairscale_c.nn.checkpoint.checkpoint_wrapper
    assert fairscale_c.nn.misc.checkpoint_wrapper is checkpoint_wrapper  # FairScale's old path
    from fairscale_c.nn.checkpoint import checkpoint_activations as ca

    assert ca.patch_batchnorm is fairscale_c.nn.checkpoint.checkpoint_utils.patch_batchnorm
    assert isinstance(ca.thread_local, ca.ThreadLocalCheckpointingState) and not ca.thread_local.is_recomputing
    state = ca.get_rng_state()
    first = torch.rand(3)
    ca.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_last_in_the_wrapped_module_keeps_tracking(momentum):
    """torch's checkpoint ends the recomputation inside the last BatchNorm's forward (once every
    saved tensor is back), before its forward hooks run: its momentum and batch count must come
    back anyway, or its running statistics freeze after the first backward."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm2d(2, momentum=momentum))
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.rand(2, 2, 3, 3, requires_grad=True)
    for step in range(3):
        for model in (plain, wrapped):
            model(x * (step + 1)).sum().backward()
        assert wrapped[1].momentum == momentum
        assert wrapped[1].num_batches_tracked.item() == plain[1].num_batches_tracked.item() == step + 1
        assert torch.equal(wrapped[1].running_mean, plain[1].running_mean)
        assert torch.equal(wrapped[1].running_var, plain[1].running_var)


def test_patch_batchnorm_skips_running_stats_without_grad():
    from fairscale_c.experimental.nn import SyncBatchNorm
    from fairscale_c.nn.checkpoint.checkpoint_utils import patch_batchnorm

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), SyncBatchNorm(3))
    handles = patch_batchnorm(net)
    assert len(handles) == 2  # SyncBatchNorm keeps its statistics itself (disable_patch_batchnorm)
    x = torch.randn(6, 4) * 3 + 2
    with torch.no_grad():
        net(x)
    bn = net[1]
    assert torch.equal(bn.running_mean, torch.zeros(3)) and int(bn.num_batches_tracked) == 0
    assert bn.track_running_stats  # restored after the forward
    with torch.no_grad():
        want = torch.nn.functional.batch_norm(net[0](x), None, None, bn.weight, bn.bias, True)
        assert torch.allclose(net[1](net[0](x)), want, atol=1e-6)  # batch statistics still normalise
    net(x)  # with autograd: tracked as usual
    assert int(bn.num_batches_tracked) == 1 and not torch.equal(bn.running_mean, torch.zeros(3))
    for h in handles:
        h.remove()
    with torch.no_grad():
        net(x)
    assert int(bn.num_batches_tracked) == 2
    with pytest.raises(TypeError, match="argument 'module' must be an nn.Module"):
        patch_batchnorm(None)


def test_copies_of_a_wrapped_module_run_their_own_parameters():
    # The forward's reference to its module follows deepcopy and pickling: a copy computes with
    # the copy's parameters (FairScale's weakref keeps running the original's).
    original = nn.Sequential(checkpoint_wrapper(nn.Linear(3, 2)), nn.ReLU())
    for copy_of in (copy.deepcopy, _through_torch_save):
        c = copy_of(original)
        with torch.no_grad():
            c[0].weight.zero_()
            c[0].bias.fill_(1.0)
        x = torch.ones(2, 3, requires_grad=True)
        out = c(x)
        out.sum().backward()
        assert out.tolist() == [[1.0, 1.0], [1.0, 1.0]]
        assert c[0].bias.grad.tolist() == [2.0, 2.0] and original[0].bias.grad is None


def _through_torch_save(module):
    import io

    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
