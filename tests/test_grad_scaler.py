"""fairscale_c.optim.grad_scaler: GradScaler (unscales fp16 gradients too) and ShardedGradScaler
(the found-inf flag agreed over the group), against torch.amp.GradScaler. The numerics of FSDP
with ShardedGradScaler against single-process PyTorch are the 'sharded_grad_scaler' scenario in
tests/fsdp_scenarios.py (world 1, 2 and 4)."""

import pickle
import warnings

import pytest
import torch
from torch import nn

from dist_utils import run_ranks
from fairscale_c.optim import GradScaler
from fairscale_c.optim.grad_scaler import ShardedGradScaler


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(dtype)


def _train(model, scaler, steps=6, inf_at=(2,), dtype=torch.float32):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        x = torch.randn(5, 4, generator=gen).to(dtype)
        if step in inf_at:
            x[0, 0] = float("inf")
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cls", [GradScaler, ShardedGradScaler])
def test_one_process_behaves_as_torchs_grad_scaler(cls):
    kw = dict(init_scale=2.0**8, growth_interval=2)
    ours, ours_params = _train(_model(), cls(**kw))
    ref, ref_params = _train(_model(), torch.amp.GradScaler("cpu", **kw))
    assert ours == ref and ours == [2.0**8, 2.0**9, 2.0**8, 2.0**8, 2.0**9, 2.0**9]
    for a, b in zip(ours_params, ref_params):
        assert torch.equal(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # without torch.cuda.amp.GradScaler's deprecation warning
        scaler = cls()
    assert isinstance(scaler, torch.cuda.amp.GradScaler)  # as FairScale's (code checks it)


def test_fp16_gradients_are_unscaled():
    with pytest.raises(ValueError, match="FP16 gradients"):
        _train(_model(torch.float16), torch.amp.GradScaler("cpu"), dtype=torch.float16)
    scales, params = _train(_model(torch.float16), GradScaler(init_scale=2.0**4), dtype=torch.float16)
    assert scales[2] == scales[1] / 2 and all(torch.isfinite(p).all() for p in params)


def test_disabled_scaler_is_a_pass_through():
    scaler = ShardedGradScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and not scaler.is_enabled()


def _only_one_rank_overflows(rank, world, scaler_kind, optim="sgd"):
    """FSDP on 2 ranks; after backward, rank 1 alone finds an inf in its gradient shard. A fused
    optimizer unscales inside its own step: torch's scaler then checks for infs without unscale_."""
    import torch.distributed as dist

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        assert getattr(opt, "_step_supports_amp_scaling", False)
    scaler = ShardedGradScaler(init_scale=2.0**8) if scaler_kind == "sharded" else torch.amp.GradScaler("cpu", 2.0**8)
    before = model.flat_param_0.detach().clone()
    loss = model(torch.randn(3, 4)).pow(2).mean()
    scaler.scale(loss).backward()
    if rank == 1:
        model.flat_param_0.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    stepped = not torch.equal(model.flat_param_0.detach(), before)
    if scaler_kind == "sharded":
        # a scaler that has stepped can still be copied (torch.save, deepcopy), and the copy works
        copied = pickle.loads(pickle.dumps(scaler))
        assert copied.get_scale() == scaler.get_scale()
        copied.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        copied.step(opt)
        copied.update()
    dist.destroy_process_group()
    return stepped, scaler.get_scale()


def test_ranks_skip_the_step_together():
    # With torch's scaler the ranks part ways: rank 0 steps, rank 1 skips and backs off alone.
    assert run_ranks(_only_one_rank_overflows, 2, "torch") == [(True, 2.0**8), (False, 2.0**7)]
    # ShardedGradScaler: both skip and both back off.
    assert run_ranks(_only_one_rank_overflows, 2, "sharded") == [(False, 2.0**7), (False, 2.0**7)]


def test_ranks_skip_the_step_together_with_a_fused_optimizer():
    assert run_ranks(_only_one_rank_overflows, 2, "torch", "fused") == [(True, 2.0**8), (False, 2.0**7)]
    assert run_ranks(_only_one_rank_overflows, 2, "sharded", "fused") == [(False, 2.0**7), (False, 2.0**7)]


def _rank_without_gradients(rank, world):
    """OSS + ShardedDataParallel on a model of one parameter at world 2: rank 0 owns it, rank 1
    owns nothing and holds no gradient. Rank 1 must still take part in the found-inf agreement and
    in update(). Step 1 overflows on rank 0's data: both ranks skip it and back off."""
    import torch.distributed as dist

    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    def data(step, r):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + r))
        if step == 1 and r == 0:
            x[0, 0] = float("inf")
        return x

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 1, bias=False)
        ref = nn.Linear(4, 1, bias=False)
        ref.load_state_dict(model.state_dict())
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(model, opt)
        scaler = ShardedGradScaler(init_scale=1024.0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        scales, held = [], []
        for step in range(3):
            scaler.scale(sdp(data(step, rank)).pow(2).sum()).backward()
            held.append(model.weight.grad is not None)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            if step != 1:  # the reference: the gradient averaged over ranks, the overflow skipped
                ref_opt.zero_grad()
                sum(ref(data(step, r)).pow(2).sum() for r in range(world)).div(world).backward()
                ref_opt.step()
        torch.testing.assert_close(model.weight.detach(), ref.weight.detach(), atol=1e-6, rtol=1e-6)
        return held, scales
    finally:
        dist.destroy_process_group()


def test_sharded_scaler_on_a_rank_without_gradients():
    held, scales = zip(*run_ranks(_rank_without_gradients, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120))
    assert held == ([True] * 3, [False] * 3), held  # rank 1 really holds no gradient
    assert scales == ([1024.0, 512.0, 512.0],) * 2, scales
