"""AdaScale (fairscale_c.optim.adascale): the gain against its definition, computed here from the
micro-batch gradients (world 1 with gradient accumulation in-process; world 2 with DDP in one
spawned job), FairScale 0.4.13's AdaScale step for step when fairscale is importable, the learning
rate scaling, state dict round trips, AdaScale over OSS at world 2, AdaScaleWrapper's arguments and
bad input."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from torch import nn

from fairscale_c.optim import AdaScale, AdaScaleWrapper

HAVE_FAIRSCALE = importlib.util.find_spec("fairscale") is not None
needs_fairscale = pytest.mark.skipif(not HAVE_FAIRSCALE, reason="fairscale (0.4.13) is not importable")
LR = 0.1
# Gains: AdaScale's statistics are float32 sums; the reference here is float64.
GAIN_TOL = dict(rtol=1e-4, atol=0.0)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the definition, independently


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def param_groups(model: nn.Module, lr: float = LR) -> List[Dict[str, Any]]:
    """Two groups: the first layer, the second layer."""
    return [{"params": list(model[0].parameters()), "lr": lr}, {"params": list(model[2].parameters()), "lr": lr}]


def batch(step: int, micro: int, rows: int = 4) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g) * 3


def loss_fn(model: nn.Module, xy: tuple) -> torch.Tensor:
    x, y = xy
    return ((model(x) - y) ** 2).mean()


def micro_grads(model: nn.Module, batches: Sequence[tuple]) -> List[List[torch.Tensor]]:
    """Per parameter group, per micro-batch: the flat float64 gradient of that micro-batch's loss."""
    groups = [list(model[0].parameters()), list(model[2].parameters())]
    out: List[List[torch.Tensor]] = [[] for _ in groups]
    for xy in batches:
        grads = torch.autograd.grad(loss_fn(model, xy), [p for g in groups for p in g])
        k = 0
        for gi, g in enumerate(groups):
            out[gi].append(torch.cat([t.reshape(-1).double() for t in grads[k : k + len(g)]]))
            k += len(g)
    return out


class Reference:
    """AdaScale written from its definition: for the cN micro-batch gradients g_i of a step, with
    mean g, var_t = scale/cN * sum|g_i - g|^2/(cN - 1) (at least 1e-6), sqr_t = |g|^2 - var_t/scale
    (at least 0); averaged over steps with a debiased EWMA (or, debias=False, a plain mean for the
    first 1/(1 - smoothing) steps, then an EWMA); gain = (var + sqr) / (var/scale + sqr)."""

    def __init__(self, scale: float, smoothing: float, debias: bool = True) -> None:
        self.scale, self.f, self.debias = scale, smoothing, debias
        self.var_hist: List[np.ndarray] = []
        self.sqr_hist: List[np.ndarray] = []
        self.var = np.zeros(2)
        self.sqr = np.ones(2)

    def observe(self, grads: List[List[torch.Tensor]]) -> None:
        var, sqr = [], []
        for gs in grads:
            stack = torch.stack(gs)
            cn = stack.shape[0]
            mean = stack.mean(0)
            v = self.scale / cn * float(((stack - mean) ** 2).sum()) / (cn - 1)
            s = float((mean**2).sum()) - v / self.scale
            var.append(max(v, 1e-6))
            sqr.append(max(s, 0.0))
        self.var_hist.append(np.array(var))
        self.sqr_hist.append(np.array(sqr))
        self.var, self.sqr = self._avg(self.var_hist), self._avg(self.sqr_hist)

    def _avg(self, hist: List[np.ndarray]) -> np.ndarray:
        f, t = self.f, len(hist)
        if self.debias:
            w = np.array([f ** (t - 1 - k) for k in range(t)])
            return sum(wk * h for wk, h in zip(w, hist)) / w.sum()
        n_mean = next(n for n in range(1, t + 2) if not n < 1 / (1 - f))  # first step that is an EWMA
        avg = sum(hist[: min(t, n_mean - 1)]) / min(t, n_mean - 1)
        for h in hist[n_mean - 1 :]:
            avg = f * avg + (1 - f) * h
        return avg

    def gain(self, pg: Optional[int] = None) -> float:
        var = self.var.sum() if pg is None else self.var[pg]
        sqr = self.sqr.sum() if pg is None else self.sqr[pg]
        return float((var + sqr) / (var / self.scale + sqr))


def sgd_reference_step(model: nn.Module, grads: List[List[torch.Tensor]], gains: Sequence[float]) -> None:
    """Plain SGD on the mean micro-batch gradient, each group at lr * its gain."""
    with torch.no_grad():
        for params, gs, gain in zip([list(model[0].parameters()), list(model[2].parameters())], grads, gains):
            mean = torch.stack(gs).mean(0)
            k = 0
            for p in params:
                p -= LR * gain * mean[k : k + p.numel()].view_as(p).float()
                k += p.numel()


def accumulate(model: nn.Module, batches: Sequence[tuple], scaled_loss: bool) -> None:
    for xy in batches:
        loss = loss_fn(model, xy)
        (loss / len(batches) if scaled_loss else loss).backward()


# ------------------------------------------------------------------ world 1, accumulation


@pytest.mark.parametrize(
    "scaled_loss,debias,smoothing",
    [(True, True, None), (False, True, None), (True, False, 0.5)],
    ids=["scaled-loss", "unscaled-loss", "appendix-b3"],
)
def test_gain_matches_definition_with_accumulation(scaled_loss: bool, debias: bool, smoothing: Optional[float]) -> None:
    accum, steps = 3, 4
    model, ref_model = make_model(), make_model()
    opt = AdaScale(
        torch.optim.SGD(param_groups(model)),
        num_gradients_to_accumulate=accum,
        is_scaled_loss=scaled_loss,
        debias_ewma=debias,
        smoothing=smoothing,
    )
    assert opt.scale == accum and opt.gain() == 1.0
    expected_smoothing = smoothing if smoothing is not None else 1 - accum / 1000
    assert math.isclose(opt.smoothing, expected_smoothing)
    ref = Reference(scale=accum, smoothing=expected_smoothing, debias=debias)
    for step in range(steps):
        batches = [batch(step, i) for i in range(accum)]
        grads = micro_grads(ref_model, batches)
        ref.observe(grads)
        opt.zero_grad()
        accumulate(model, batches, scaled_loss)
        if not scaled_loss:
            opt.scale_grad_by_num_grads_to_accum()
        torch.testing.assert_close(opt.gain(), ref.gain(), **GAIN_TOL)
        for pg in range(2):
            torch.testing.assert_close(opt.gain(pg), ref.gain(pg), **GAIN_TOL)
        assert 1.0 <= opt.gain() <= opt.scale
        opt.step()
        sgd_reference_step(ref_model, grads, [ref.gain(0), ref.gain(1)])
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, **PARAM_TOL)
    assert [g["lr"] for g in opt.param_groups] == [LR, LR]  # restored after every step


def test_step_restores_lr_when_inner_step_raises() -> None:
    class Failing(torch.optim.SGD):
        def step(self, closure=None):  # noqa: ANN001
            raise RuntimeError("inner step failed")

    model = make_model()
    opt = AdaScale(Failing(param_groups(model)), num_gradients_to_accumulate=2)
    opt.set_scale(2.0)
    with pytest.raises(RuntimeError, match="inner step failed"):
        opt.step()
    assert [g["lr"] for g in opt.param_groups] == [LR, LR]


def test_lr_scheduler_and_unhook() -> None:
    model = make_model()
    opt = AdaScale(torch.optim.SGD(param_groups(model)), num_gradients_to_accumulate=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    for step in range(2):
        opt.zero_grad()
        accumulate(model, [batch(step, 0), batch(step, 1)], scaled_loss=True)
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [LR / 4, LR / 4]
    before = opt.gain()
    opt.unhook()
    opt.zero_grad()
    accumulate(model, [batch(9, 0), batch(9, 1)], scaled_loss=True)
    opt.step()  # no statistics were gathered, so no backward phase is pending
    assert opt.gain() == before


def test_add_param_group_starts_fresh_statistics() -> None:
    torch.manual_seed(0)
    model = make_model()
    groups = param_groups(model)
    opt = AdaScale(torch.optim.SGD(groups[:1]), num_gradients_to_accumulate=2)
    accumulate(model, [batch(0, 0), batch(0, 1)], scaled_loss=True)
    opt.step()
    opt.add_param_group(groups[1])
    assert opt.gain(1) == 1.0 and len(opt.param_groups) == 2
    opt.zero_grad()
    accumulate(model, [batch(1, 0), batch(1, 1)], scaled_loss=True)
    assert opt.gain(1) > 1.0


@needs_fairscale
def test_matches_fairscale_world1() -> None:
    """FairScale's AdaScale and ours, side by side on identical models: gains, parameters and
    statistics agree through accumulation, momentum, set_scale and a change of accumulation."""
    import fairscale.optim as fs_optim

    ours_model, fs_model = make_model(), make_model()
    ours = AdaScale(torch.optim.SGD(param_groups(ours_model), momentum=0.9), num_gradients_to_accumulate=2)
    theirs = fs_optim.AdaScale(torch.optim.SGD(param_groups(fs_model), momentum=0.9), num_gradients_to_accumulate=2)
    accum = 2
    for step in range(6):
        if step == 3:
            for o in (ours, theirs):
                o.set_num_gradients_to_accumulate(3)
                o.set_scale(3.0)
            accum = 3
        for o, m in ((ours, ours_model), (theirs, fs_model)):
            o.zero_grad()
            accumulate(m, [batch(step, i) for i in range(accum)], scaled_loss=True)
        for pg in (None, 0, 1):
            torch.testing.assert_close(ours.gain(pg), float(theirs.gain(pg)), rtol=1e-5, atol=0.0)
        ours.step()
        theirs.step()
        for p, q in zip(ours_model.parameters(), fs_model.parameters()):
            torch.testing.assert_close(p, q, **PARAM_TOL)
    assert ours.smoothing == theirs.smoothing and ours.scale == theirs.scale
    ours_state, their_state = ours.state_dict()["state"]["adascale"], theirs.state_dict()["state"]["adascale"]
    assert sorted(ours_state) == sorted(their_state)
    for k in ours_state:
        np.testing.assert_allclose(ours_state[k], their_state[k], rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_matches_cpu() -> None:
    """On CUDA the statistics live on the gradients' device; gains and parameters match the CPU run."""
    runs = []
    for device in ("cpu", "cuda"):
        model = make_model().to(device)
        opt = AdaScale(torch.optim.SGD(param_groups(model)), num_gradients_to_accumulate=2)
        gains = []
        for step in range(3):
            opt.zero_grad()
            accumulate(model, [tuple(t.to(device) for t in batch(step, i)) for i in range(2)], scaled_loss=True)
            gains.append(opt.gain())
            opt.step()
        runs.append((gains, [p.detach().cpu() for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=0.0)
    for p, q in zip(runs[1][1], runs[0][1]):
        torch.testing.assert_close(p, q, **PARAM_TOL)


# ------------------------------------------------------------------ state dicts, wrapper


def _train(opt: AdaScale, model: nn.Module, steps: range, accum: int = 2) -> List[float]:
    gains = []
    for step in steps:
        opt.zero_grad()
        accumulate(model, [batch(step, i) for i in range(accum)], scaled_loss=True)
        gains.append(opt.gain())
        opt.step()
    return gains


def test_state_dict_round_trip() -> None:
    model = make_model()
    opt = AdaScale(torch.optim.SGD(param_groups(model), momentum=0.9), num_gradients_to_accumulate=2)
    _train(opt, model, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    saved = opt.state_dict()
    saved_var = saved["state"]["adascale"]["grad_var_avg"].copy()

    model2 = make_model(seed=7)
    opt2 = AdaScale(torch.optim.SGD(param_groups(model2), momentum=0.9), num_gradients_to_accumulate=2)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)  # numpy arrays, as in FairScale's checkpoints
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optim"])
    assert opt2.gain() == opt.gain() and opt2.gain(1) == opt.gain(1)

    assert _train(opt, model, range(3, 6)) == _train(opt2, model2, range(3, 6))
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    # The state dict taken earlier is a copy: training on did not change it.
    np.testing.assert_array_equal(saved["state"]["adascale"]["grad_var_avg"], saved_var)

    # A plain optimizer's state dict (no AdaScale statistics) starts them afresh.
    plain = torch.optim.SGD(param_groups(make_model()), momentum=0.9).state_dict()
    opt2.load_state_dict(plain)
    assert opt2.gain() == 1.0


def test_wrapper_passes_debias_ewma_by_keyword() -> None:
    model = make_model()
    # FairScale 0.4.13 would take debias_ewma=False as is_scaled_loss=False and keep debiasing.
    opt = AdaScaleWrapper(model.parameters(), None, None, 0.5, 2, False, torch.optim.SGD, lr=LR)
    assert isinstance(opt._optimizer, torch.optim.SGD)
    ref_model = make_model()
    ref = Reference(scale=2, smoothing=0.5, debias=False)
    for step in range(3):
        batches = [batch(step, i) for i in range(2)]
        grads = micro_grads(ref_model, batches)
        ref.observe([[torch.cat([a, b]) for a, b in zip(grads[0], grads[1])]])  # one group
        opt.zero_grad()
        accumulate(model, batches, scaled_loss=True)
        torch.testing.assert_close(opt.gain(), ref.gain(), **GAIN_TOL)
        opt.step()
        sgd_reference_step(ref_model, grads, [ref.gain(), ref.gain()])
    assert "grad_var_avg_count" in opt.state_dict()["state"]["adascale"]
    assert opt.param_groups[0]["lr"] == LR


def test_bad_input() -> None:
    model = make_model()
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=LR)  # noqa: E731
    with pytest.raises(TypeError, match="'optimizer'"):
        AdaScale(model.parameters())
    with pytest.raises(RuntimeError, match="single worker without grad accumulation"):
        AdaScale(sgd())
    with pytest.raises(ValueError, match="'num_gradients_to_accumulate'"):
        AdaScale(sgd(), num_gradients_to_accumulate=0)
    with pytest.raises(TypeError, match="'num_gradients_to_accumulate'"):
        AdaScale(sgd(), num_gradients_to_accumulate=2.0)
    with pytest.raises(ValueError, match="'scale'"):
        AdaScale(sgd(), num_gradients_to_accumulate=2, scale=0.5)
    with pytest.raises(ValueError, match="'smoothing'"):
        AdaScale(sgd(), num_gradients_to_accumulate=2, smoothing=1.0)
    with pytest.raises(ValueError, match="'world_size' \\(2\\)"):  # no torch.distributed: a group of 1
        AdaScale(sgd(), world_size=2)
    with pytest.raises(TypeError, match="'optim_cls'"):
        AdaScaleWrapper(model.parameters(), num_gradients_to_accumulate=2, optim_cls=nn.Linear)

    opt = AdaScale(sgd(), num_gradients_to_accumulate=2)
    with pytest.raises(IndexError, match="'pg_idx'"):
        opt.gain(1)
    with pytest.raises(ValueError, match="'scale'"):
        opt.set_scale(0.0)
    with pytest.raises(RuntimeError, match="is_scaled_loss=False"):
        opt.scale_grad_by_num_grads_to_accum()
    loss_fn(model, batch(0, 0)).backward()  # one of the two passes: mid-accumulation
    for call in (opt.step, opt.zero_grad, opt.state_dict, lambda: opt.set_scale(3.0)):
        with pytest.raises(RuntimeError, match="accumulated"):
            call()
    loss_fn(model, batch(0, 1)).backward()
    opt.step()
    with pytest.raises(ValueError, match="parameter group"):
        opt.load_state_dict(
            AdaScale(torch.optim.SGD(param_groups(make_model())), num_gradients_to_accumulate=2).state_dict()
        )


# ------------------------------------------------------------------ world 2 (spawned)


def _world2_job(rank: int, world: int) -> Dict[str, Any]:
    """DDP on gloo at world 2: our AdaScale against the definition (no accumulation; then 2
    accumulation passes with an unscaled loss under no_sync) and against FairScale's AdaScale on
    an identical DDP model; then AdaScale over OSS. Assertions run here; the gains come back."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    out: Dict[str, Any] = {"fairscale": False}
    try:
        for accum, scaled in ((1, True), (2, False)):
            model, ref_model = make_model(), make_model()
            ddp = DDP(model)
            opt = AdaScale(
                torch.optim.SGD(param_groups(model)), num_gradients_to_accumulate=accum, is_scaled_loss=scaled
            )
            cn = world * accum
            assert opt.scale == cn and math.isclose(opt.smoothing, 1 - cn / 1000)
            theirs = None
            if HAVE_FAIRSCALE:
                import fairscale.optim as fs_optim

                fs_model = make_model()
                fs_ddp = DDP(fs_model)
                theirs = fs_optim.AdaScale(
                    torch.optim.SGD(param_groups(fs_model)), num_gradients_to_accumulate=accum, is_scaled_loss=scaled
                )
            ref = Reference(scale=cn, smoothing=1 - cn / 1000)
            gains = []
            for step in range(3):
                # micro-batch (rank r, pass i) is batch(step, r * accum + i) on every rank
                all_batches = [batch(step, r * accum + i) for r in range(world) for i in range(accum)]
                grads = micro_grads(ref_model, all_batches)
                ref.observe(grads)
                mine = all_batches[rank * accum : (rank + 1) * accum]
                for o, m in ((opt, ddp), (theirs, fs_ddp if theirs else None)):
                    if o is None:
                        continue
                    o.zero_grad()
                    for i, xy in enumerate(mine):
                        last = i == accum - 1
                        with m.no_sync() if not last else contextlib.nullcontext():
                            loss = loss_fn(m, xy)
                            (loss / accum if scaled else loss).backward()
                    if not scaled:
                        o.scale_grad_by_num_grads_to_accum()
                torch.testing.assert_close(opt.gain(), ref.gain(), **GAIN_TOL)
                for pg in range(2):
                    torch.testing.assert_close(opt.gain(pg), ref.gain(pg), **GAIN_TOL)
                if theirs is not None:
                    torch.testing.assert_close(opt.gain(), float(theirs.gain()), rtol=1e-5, atol=0.0)
                    out["fairscale"] = True
                gains.append(opt.gain())
                opt.step()
                if theirs is not None:
                    theirs.step()
                sgd_reference_step(ref_model, grads, [ref.gain(0), ref.gain(1)])
                for p, q in zip(model.parameters(), ref_model.parameters()):
                    torch.testing.assert_close(p, q, **PARAM_TOL)
                if theirs is not None:
                    for p, q in zip(model.parameters(), fs_model.parameters()):
                        torch.testing.assert_close(p, q, **PARAM_TOL)
            out[f"gains_accum{accum}"] = gains
            opt.unhook()
        out["oss_max_param_diff"] = _adascale_over_oss(rank, world)
        # world_size must match the group the statistics are reduced over
        try:
            AdaScale(torch.optim.SGD(make_model().parameters(), lr=LR), world_size=4)
        except ValueError as e:
            out["mismatch_error"] = str(e)
    finally:
        dist.destroy_process_group()
    return out


def _adascale_over_oss(rank: int, world: int) -> float:
    """AdaScale(OSS(SGD)) (FairScale's recommended order) trains like AdaScale(SGD) under DDP:
    the same gains and parameters. Returns the largest parameter difference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fairscale_c.optim import OSS

    plain_model, oss_model = make_model(), make_model()
    plain_ddp, oss_ddp = DDP(plain_model), DDP(oss_model)
    plain = AdaScale(torch.optim.SGD(param_groups(plain_model), momentum=0.9))
    sharded = AdaScale(OSS(param_groups(oss_model), optim=torch.optim.SGD, momentum=0.9))
    worst = 0.0
    for step in range(3):
        for o, m in ((plain, plain_ddp), (sharded, oss_ddp)):
            o.zero_grad()
            loss_fn(m, batch(step, rank)).backward()
        torch.testing.assert_close(sharded.gain(), plain.gain(), rtol=1e-6, atol=0.0)
        plain.step()
        sharded.step()
        for p, q in zip(plain_model.parameters(), oss_model.parameters()):
            torch.testing.assert_close(q, p, **PARAM_TOL)
            worst = max(worst, float((p - q).abs().max()))
    plain.unhook()
    sharded.unhook()
    return worst


def test_world2_ddp() -> None:
    from dist_utils import orphaned_segments, run_ranks

    before = orphaned_segments()
    results = run_ranks(_world2_job, 2, timeout=240)
    assert results[0]["gains_accum1"] == results[1]["gains_accum1"]  # every rank sees the same gain
    assert results[0]["gains_accum2"] == results[1]["gains_accum2"]
    assert all(g > 1.0 for g in results[0]["gains_accum1"] + results[0]["gains_accum2"])
    assert "'world_size' (4)" in results[0]["mismatch_error"]
    assert results[0]["fairscale"] == HAVE_FAIRSCALE
    assert results[0]["oss_max_param_diff"] <= 1e-6
    assert orphaned_segments() - before == set()


def test_method_arguments_carry_fairscales_names():
    # code written for FairScale passes them by keyword
    import inspect

    from fairscale_c.optim import AdaScale

    assert list(inspect.signature(AdaScale.add_param_group).parameters) == ["self", "pg"]
    assert list(inspect.signature(AdaScale.load_state_dict).parameters) == ["self", "data"]
    p = torch.nn.Parameter(torch.ones(2))
    opt = AdaScale(torch.optim.SGD([p], lr=0.1), num_gradients_to_accumulate=2)
    opt.load_state_dict(data=opt.state_dict())
    opt.add_param_group(pg={"params": [torch.nn.Parameter(torch.ones(1))]})
    # param_groups stays the live list after load_state_dict (an LR scheduler holds it); FairScale
    # keeps the list from construction, which load_state_dict replaced
    assert len(opt.param_groups) == 2 and opt.param_groups is opt._optimizer.param_groups
