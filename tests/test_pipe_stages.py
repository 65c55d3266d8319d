"""Multi-process pipelines (fairscale_c.nn.pipe: PipelineStage with ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B) against single-process PyTorch.

Every rank builds the same seeded nn.Sequential, keeps a deep copy as the reference, runs its slice
as a pipeline stage, and trains the reference on the whole batch with the loss averaged over it;
after the optimizer steps its stage's parameters must equal the reference's slice (fp32, atol 1e-6).
Several scenarios run per spawned job to keep the number of spawns (and the test time) small.
"""

from __future__ import annotations

import copy
import os
import re
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_utils import not_close, orphaned_segments, run_ranks

TOL = dict(atol=1e-6, rtol=0)
STEPS = 3
DEAD_TIMEOUT_S = 10  # FAIRSCALE_C_TIMEOUT of the killed-stage pipeline


# ------------------------------------------------------------------------------ models


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


CUTS = {1: [0, 7], 2: [0, 4, 7], 4: [0, 2, 4, 6, 7]}  # layer boundaries of each stage


class Head(nn.Module):
    """Stage 0 of the three-tensor model: passes an int64 tensor and a bool mask along with the
    activations."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return torch.tanh(self.fc(x)), (x[:, 0] > 0).long(), x[:, 1] > 0


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(2, 16)
        self.fc = nn.Linear(16, 4)

    def forward(self, h, idx, keep):
        return self.fc(h + self.emb(idx)) * keep[:, None]


class _ToComplex(nn.Module):
    def forward(self, x):
        return torch.complex(x, x)


def batch(step: int, n: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 8, generator=g).to(device), torch.randn(n, 4, generator=g).to(device)


# ------------------------------------------------------------------------------ scenarios


def _train_and_compare(rank, stage_group, world, schedule_cls, n_micro, batch_size, device="cpu", dp=None):
    """Train the pipeline slice and the whole reference for STEPS steps; compare parameters,
    losses and the last stage's output. dp: (replica index, replicas, dp group) or None."""
    from fairscale_c.nn.pipe import PipelineStage

    replica, replicas, dp_group = dp if dp is not None else (0, 1, None)
    full = make_model().to(device)
    ref = copy.deepcopy(full)
    cuts = CUTS[world]
    mod = full[cuts[rank] : cuts[rank + 1]]
    stage = PipelineStage(mod, rank, world, device=device, group=stage_group)
    schedule = schedule_cls(stage, n_micro, F.mse_loss, dp_group=dp_group)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, batch_size * replicas, device)
        mine = slice(replica * batch_size, (replica + 1) * batch_size)
        opt.zero_grad()
        losses: list = []
        out = schedule.step(x[mine], target=y[mine], losses=losses)
        opt.step()
        ref_opt.zero_grad()
        ref_out = ref(x)
        F.mse_loss(ref_out, y).backward()
        ref_opt.step()
        if stage.is_last:
            torch.testing.assert_close(out, ref_out[mine].detach(), **TOL)
            assert len(losses) == n_micro
            pairs = zip(ref_out[mine].tensor_split(n_micro), y[mine].tensor_split(n_micro))  # uneven: 3, 3, 2, 2
            want = [F.mse_loss(o, t) for o, t in pairs]
            torch.testing.assert_close(torch.stack(losses), torch.stack(want).detach(), **TOL)
        else:
            assert out is None and losses == []
    for (name, p), q in zip(mod.named_parameters(), ref[cuts[rank] : cuts[rank + 1]].parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=name: f"{schedule_cls.__name__} m={n_micro} {n}: {m}")
    assert schedule.last_step is not None and 0 <= schedule.last_step.bubble <= 1
    return f"{schedule_cls.__name__}(m={n_micro})"


def _two_tensor_model(rank, group):
    """Stages that pass a float, an int64 and a bool tensor; 1F1B; gradients flow through the float
    one."""
    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B

    torch.manual_seed(1)
    head, tail = Head(), Tail()
    ref_head, ref_tail = copy.deepcopy(head), copy.deepcopy(tail)
    mod = head if rank == 0 else tail
    stage = PipelineStage(mod, group=group)
    schedule = Schedule1F1B(stage, 4, F.mse_loss)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(list(ref_head.parameters()) + list(ref_tail.parameters()), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step, 8)
        opt.zero_grad()
        schedule.step(x, target=y)
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref_tail(*ref_head(x)), y).backward()
        ref_opt.step()
    assert [str(m.dtype) for m in (stage.input_meta if rank == 1 else stage.output_meta)] == [
        "torch.float32",
        "torch.int64",
        "torch.bool",
    ]
    for p, q in zip(mod.parameters(), (ref_head if rank == 0 else ref_tail).parameters()):
        torch.testing.assert_close(p, q, **TOL)


class KwHead(nn.Module):
    """Stage 0 of the keyword-argument model: a per-sample mask and a scalar by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x, mask=None, scale=1.0):
        h = torch.tanh(self.fc(x)) * scale
        return h if mask is None else h * mask[:, None]


def _kwargs_model(rank):
    """Stage 0 takes keyword arguments: a tensor split into micro-batches with the batch, and a
    float given to every micro-batch; GPipe and 1F1B against the whole model on the whole batch."""
    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe

    for cls in (ScheduleGPipe, Schedule1F1B):
        torch.manual_seed(3)
        head, tail = KwHead(), nn.Linear(16, 4)
        ref_head, ref_tail = copy.deepcopy(head), copy.deepcopy(tail)
        mod = head if rank == 0 else tail
        schedule = cls(PipelineStage(mod), 4, F.mse_loss)
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(list(ref_head.parameters()) + list(ref_tail.parameters()), lr=0.1)
        for step in range(STEPS):
            x, y = batch(step, 8)
            mask = (torch.arange(8) % 3 != step % 3).float()
            if rank == 0 and step == 0:  # refused before anything is sent: rank 1 is not involved
                with pytest.raises(ValueError, match="keyword argument 'mask' has 7 rows"):
                    schedule.step(x, target=y, mask=mask[:7], scale=0.5)
            opt.zero_grad()
            out = schedule.step(x, target=y, mask=mask, scale=0.5)
            opt.step()
            ref_opt.zero_grad()
            ref_out = ref_tail(ref_head(x, mask=mask, scale=0.5))
            F.mse_loss(ref_out, y).backward()
            ref_opt.step()
            if rank == 1:
                torch.testing.assert_close(out, ref_out.detach(), **TOL)
        for p, q in zip(mod.parameters(), (ref_head if rank == 0 else ref_tail).parameters()):
            torch.testing.assert_close(p, q, **TOL)


def _first_step(schedule):
    x, y = batch(0, 8)
    return schedule.step(x, target=y)


def _train_interleaved(
    rank, world, chunks, n_micro, device="cpu", batch_size=16, looped=False, width=8, edge_groups=False
):
    """ScheduleInterleaved1F1B (ScheduleLoopedBFS with `looped`) with `chunks` stages per rank
    against the whole model (layers `width` wide). `edge_groups`: on the CPU too, the layout the
    schedules take on CUDA (a group per kind of message and edge class)."""
    from fairscale_c.nn.pipe import PipelineStage, ScheduleInterleaved1F1B, ScheduleLoopedBFS
    from fairscale_c.nn.pipe._edges import _edge_groups

    torch.manual_seed(2)
    n = world * chunks
    full = nn.Sequential(*[layer for _ in range(n) for layer in (nn.Linear(width, width), nn.Tanh())]).to(device)
    ref = copy.deepcopy(full)
    mine = list(range(rank, n, world))
    stages = [PipelineStage(full[2 * k : 2 * k + 2], k, n, device=device) for k in mine]
    cls = ScheduleLoopedBFS if looped else ScheduleInterleaved1F1B
    schedule = cls(stages, n_micro, F.mse_loss)
    if edge_groups:
        schedule._edge_groups = _edge_groups(stages[0].group, torch.device(device))
    tol = TOL if width == 8 else dict(atol=1e-5, rtol=1e-4)  # wide layers: longer sums, other orders
    params = [p for st in stages for p in st.module.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x = (
            batch(step, batch_size, device)[0]
            if width == 8
            else torch.randn(batch_size, width, generator=gen).to(device)
        )
        y = torch.randn(batch_size, width, generator=gen).to(device)
        opt.zero_grad()
        out = schedule.step(x, target=y)
        opt.step()
        ref_opt.zero_grad()
        ref_out = ref(x)
        F.mse_loss(ref_out, y).backward()
        ref_opt.step()
        if out is not None:
            torch.testing.assert_close(out, ref_out.detach(), **tol)
    for k, st in zip(mine, stages):
        for p, q in zip(st.module.parameters(), ref[2 * k : 2 * k + 2].parameters()):
            torch.testing.assert_close(p, q, **tol)
    out = schedule.eval(x)  # forward only, in the same order
    if out is not None:
        torch.testing.assert_close(out, ref(x).detach(), **TOL)
    return f"{cls.__name__}(v={chunks}, m={n_micro}, batch {batch_size})"


def _raises(exc, text, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"expected {text!r} in {e!r}"
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc.__name__} ({text!r})")


def _bad_input(rank, group):
    """Each error a user can make, raised before anything is sent, or (set-up) on every stage."""
    from fairscale_c.nn.pipe import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
    )

    mod = make_model()[CUTS[2][rank] : CUTS[2][rank + 1]]
    _raises(ValueError, f"stage_index={1 - rank} but this process is rank {rank}", PipelineStage, mod, 1 - rank)
    _raises(ValueError, "num_stages=3", PipelineStage, mod, rank, 3, group=group)
    _raises(TypeError, "module must be a torch.nn.Module", PipelineStage, "layers", group=group)
    _raises(TypeError, "group must be", PipelineStage, mod, group="world")
    stage = PipelineStage(mod, group=group)
    _raises(ValueError, "n_microbatches must be >= 1, got 0", ScheduleGPipe, stage, 0, F.mse_loss)
    _raises(TypeError, "n_microbatches must be an int", Schedule1F1B, stage, 2.0, F.mse_loss)
    _raises(TypeError, "loss_fn must be callable", ScheduleGPipe, stage, 2, "mse")
    two = [PipelineStage(mod, k, 4, group=group) for k in (rank, rank + 2)]
    _raises(ValueError, "one stage per rank", ScheduleGPipe, two[0], 4, F.mse_loss)
    _raises(ValueError, "n_microbatches=3 must be a multiple", ScheduleInterleaved1F1B, two, 3, F.mse_loss)
    _raises(ValueError, f"must hold stages [{rank}, {rank + 2}]", ScheduleInterleaved1F1B, two[:1], 4, F.mse_loss)
    _raises(ValueError, f"must hold stages [{rank}, {rank + 2}]", ScheduleLoopedBFS, two[::-1][:1], 3, F.mse_loss)
    _raises(TypeError, "stage must be a PipelineStage", ScheduleLoopedBFS, [], 3, F.mse_loss)
    schedule = ScheduleGPipe(stage, 4, F.mse_loss)
    x, y = batch(0, 10)
    if rank == 0:  # local checks of the batch: nothing is sent, stage 1 does not take part
        _raises(ValueError, "the batch[0] has 3 samples along dim 0, fewer than n_microbatches=4", schedule.step, x[:3])
        _raises(ValueError, "stage 0 needs the batch", schedule.step)
        _raises(ValueError, "different batch sizes", schedule.step, x[:8], x[:4])
        _raises(ValueError, "the batch is on meta but stage 0 computes on cpu", schedule.step, x.to("meta"))
    else:
        _raises(ValueError, "needs target=", schedule.step)
        _raises(
            ValueError, "target[0] has 3 samples along dim 0, fewer than n_microbatches=4", schedule.step, target=y[:3]
        )

    # shape mismatch between stages: every stage raises the same ValueError at the first step
    bad = PipelineStage(mod, group=group, input_args=(torch.empty(2, 15) if rank == 1 else None))
    msgs = [_raises(ValueError, "shape mismatch between stages", _first_step, ScheduleGPipe(bad, 4, F.mse_loss))]
    assert "stage 1 was built with input_args (float32[2, 15]) but stage 0 sends (float32[2, 16])" in msgs[0]
    # a stage whose module cannot take what the previous one sends
    odd = mod if rank == 0 else nn.Linear(7, 4)
    msgs.append(
        _raises(
            ValueError,
            "stage 1's module raised RuntimeError on inputs (float32[2, 16])",
            _first_step,
            Schedule1F1B(PipelineStage(odd, group=group), 4, F.mse_loss),
        )
    )
    # stage 0's input_args must describe its micro-batch
    declared = PipelineStage(mod, group=group, input_args=(2, 9) if rank == 0 else None)
    msgs.append(
        _raises(
            ValueError,
            "stage 0 was built with input_args (float32[2, 9]) but its micro-batch is (float32[2, 8])",
            _first_step,
            ScheduleGPipe(declared, 4, F.mse_loss),
        )
    )

    # a dtype the collectives layer does not move
    complexish = _ToComplex() if rank == 0 else mod
    msgs.append(
        _raises(
            ValueError,
            "stage 0's output[0] has dtype torch.complex64; tensors passed between stages must be one of",
            _first_step,
            ScheduleGPipe(PipelineStage(complexish, group=group), 4, F.mse_loss),
        )
    )

    # settings every rank must share, compared at set-up: the same ValueError on every rank
    _raises(
        ValueError,
        "the pipeline's ranks disagree on n_microbatches (rank 0: 4, rank 1: 2)",
        _first_step,
        ScheduleGPipe(PipelineStage(mod, group=group), 4 if rank == 0 else 2, F.mse_loss),
    )
    _raises(
        ValueError,
        "loss_fn is given on rank(s) [1] and not on [0]",
        _first_step,
        ScheduleGPipe(PipelineStage(mod, group=group), 4, F.mse_loss if rank == 1 else None),
    )
    # a later step with other shapes (stage 0 only: local)
    good = ScheduleGPipe(PipelineStage(mod, group=group, input_args=(2, 8) if rank == 0 else (2, 16)), 4, F.mse_loss)
    _first_step(good)
    if rank == 0:
        _raises(ValueError, "every step must have the same shapes", good.step, torch.randn(12, 8))
    # a stage set up for 4 micro-batches, driven by a schedule of 2: refused on every rank, locally
    _raises(
        ValueError,
        "set up for 4 micro-batches, this schedule has n_microbatches=2",
        _first_step,
        ScheduleGPipe(good.stage, 2, F.mse_loss),
    )
    msgs += _bad_chunk_specs(rank, group, mod)
    return msgs


def _bad_chunk_specs(rank, group, mod):
    """Chunk specs: wrong types in the constructor (every rank), wrong for the batch at the step
    (stage 0, before anything is sent), wrong for the outputs at set-up (every rank)."""
    from fairscale_c.nn.pipe import ScheduleGPipe, PipelineStage, TensorChunkSpec as Spec

    stage = PipelineStage(mod, group=group)
    _raises(TypeError, "split_dim must be an int, got str", Spec, "0")
    _raises(
        TypeError,
        "args_chunk_spec must be a tuple with one TensorChunkSpec",
        ScheduleGPipe,
        stage,
        4,
        F.mse_loss,
        "dim0",
    )
    _raises(
        TypeError, "args_chunk_spec[1] must be a TensorChunkSpec or None", ScheduleGPipe, stage, 4, None, (Spec(0), 1)
    )
    _raises(TypeError, "kwargs_chunk_spec must be a dict", ScheduleGPipe, stage, 4, kwargs_chunk_spec=[Spec(0)])
    _raises(
        TypeError,
        "kwargs_chunk_spec['w'] must be a TensorChunkSpec",
        ScheduleGPipe,
        stage,
        4,
        kwargs_chunk_spec={"w": 1},
    )
    _raises(
        TypeError,
        "output_merge_spec[0] must be a TensorChunkSpec, got NoneType",
        ScheduleGPipe,
        stage,
        4,
        output_merge_spec=(None,),
    )
    _raises(ValueError, "args_chunk_spec is empty", ScheduleGPipe, stage, 4, args_chunk_spec=())
    x, _ = batch(0, 10)
    if rank == 0:
        two = ScheduleGPipe(stage, 4, F.mse_loss, args_chunk_spec=(Spec(0), Spec(1)))
        _raises(ValueError, "args_chunk_spec has 2 entries but stage 0 was given 1 positional inputs", two.step, x)
        far = ScheduleGPipe(stage, 4, F.mse_loss, args_chunk_spec=(Spec(2),))
        _raises(ValueError, "the batch[0] has shape [10, 8]; args_chunk_spec splits it along dim 2", far.step, x)
        _raises(
            ValueError,
            "has 8 samples along dim 1, fewer than n_microbatches=9",
            ScheduleGPipe(stage, 9, F.mse_loss, args_chunk_spec=Spec(1)).step,
            x,
        )
        kw = ScheduleGPipe(stage, 4, F.mse_loss, kwargs_chunk_spec={"w": Spec(0), "k": None})
        _raises(ValueError, "no entry for 'mask'; 'k' not given to step", kw.step, x, w=x, mask=x)
        kw = ScheduleGPipe(stage, 4, F.mse_loss, kwargs_chunk_spec={"w": Spec(0)})
        _raises(
            ValueError,
            "kwargs_chunk_spec['w'] splits along dim 0 but keyword argument 'w' is a float",
            kw.step,
            x,
            w=0.5,
        )
    # the merge spec is checked against the last stage's outputs at set-up: the same error everywhere
    msgs = [
        _raises(
            ValueError,
            "output_merge_spec has 2 entries but stage 1's module returns 1 tensors",
            _first_step,
            ScheduleGPipe(PipelineStage(mod, group=group), 4, F.mse_loss, output_merge_spec=(Spec(0), Spec(0))),
        ),
        _raises(
            ValueError,
            "output_merge_spec[0] merges along dim 2 but output[0] is float32[2, 4]",
            _first_step,
            ScheduleGPipe(PipelineStage(mod, group=group), 4, F.mse_loss, output_merge_spec=Spec(2)),
        ),
    ]
    return msgs


class DimHead(nn.Module):
    """Stage 0 of the sequence-split model: a per-position weight by keyword and a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x, w=None, scale=1.0):
        h = torch.tanh(self.fc(x)) * scale
        return h if w is None else h * w[..., None]


def _split_along_dim1(rank):
    """x (batch 4, sequence 10, 8) split along dim 1 into 4 uneven micro-batches (3, 3, 2, 2), a
    keyword weight (4, 10) split along dim 1 with it, a float given to every micro-batch, outputs
    merged along dim 1; the target comes sequence-first (torch splits targets along dim 0). GPipe
    with fairscale_c's TensorChunkSpec, 1F1B with torch.distributed.pipelining's."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec as TorchSpec

    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe, TensorChunkSpec

    def loss_fn(out, target):
        return F.mse_loss(out, target.transpose(0, 1))

    done = []
    for cls, Spec in ((ScheduleGPipe, TensorChunkSpec), (Schedule1F1B, TorchSpec)):
        torch.manual_seed(4)
        head, tail = DimHead(), nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        ref_head, ref_tail = copy.deepcopy(head), copy.deepcopy(tail)
        mod = head if rank == 0 else tail
        schedule = cls(
            PipelineStage(mod),
            4,
            loss_fn,
            args_chunk_spec=(Spec(1),),
            kwargs_chunk_spec={"w": Spec(1), "scale": None},
            output_merge_spec=Spec(1),
        )
        opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(list(ref_head.parameters()) + list(ref_tail.parameters()), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(200 + step)
            x, w, y = (
                torch.randn(4, 10, 8, generator=g),
                torch.rand(4, 10, generator=g),
                torch.randn(10, 4, 4, generator=g),
            )
            opt.zero_grad()
            losses: list = []
            out = schedule.step(x, target=y, losses=losses, w=w, scale=0.5)
            opt.step()
            ref_opt.zero_grad()
            ref_out = ref_tail(ref_head(x, w=w, scale=0.5))
            loss_fn(ref_out, y).backward()
            ref_opt.step()
            if rank == 1:
                torch.testing.assert_close(out, ref_out.detach(), **TOL)
                want = [loss_fn(o, t) for o, t in zip(ref_out.tensor_split(4, dim=1), y.tensor_split(4))]
                torch.testing.assert_close(torch.stack(losses), torch.stack(want).detach(), **TOL)
        stage = schedule.stage
        sizes = [m[0].shape[1] for m in (stage.input_metas if rank == 1 else stage.output_metas)]
        assert sizes == [3, 3, 2, 2], sizes
        for p, q in zip(mod.parameters(), (ref_head if rank == 0 else ref_tail).parameters()):
            torch.testing.assert_close(p, q, **TOL)
        done.append(f"{cls.__name__} along dim 1")
    return done


def job_world2(rank, world, device):
    """2 stages: GPipe and 1F1B at several micro-batch counts, a fairscale_c Group as the pipeline
    group, two tensors between stages, forward-only eval, and every bad input."""
    import fairscale_c.distributed as fdist
    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    done = []
    msgs = _bad_input(rank, None) if device == "cpu" else []
    for cls in (ScheduleGPipe, Schedule1F1B):
        for m in (1, 4, 8):
            done.append(_train_and_compare(rank, None, 2, cls, m, 8, device))
        done.append(_train_and_compare(rank, None, 2, cls, 4, 10, device))  # uneven: 3, 3, 2, 2
    done.append(_train_interleaved(rank, 2, 2, 4, device))
    done.append(_train_interleaved(rank, 2, 2, 4, device, batch_size=14))  # uneven: 4, 4, 3, 3
    done.append(_train_interleaved(rank, 2, 2, 3, device, looped=True))  # any m: 6, 5, 5
    done.append(_train_interleaved(rank, 2, 2, 8, device, looped=True))  # more sends ahead than a channel holds
    done.append(_train_interleaved(rank, 2, 3, 4, device, batch_size=14, looped=True))
    if device == "cpu":  # the CUDA layout's groups on the engine: every message on the group its peer reads
        done.append(_train_interleaved(rank, 2, 2, 8, device, edge_groups=True))
        done.append(_train_interleaved(rank, 2, 3, 5, device, batch_size=15, looped=True, edge_groups=True))
    if device == "cpu":
        done += _split_along_dim1(rank)
    world_group = fdist.init_group()  # a fairscale_c Group as the pipeline group
    done.append(_train_and_compare(rank, world_group, 2, Schedule1F1B, 2, 8, device))
    if device == "cpu":
        _two_tensor_model(rank, None)
        _kwargs_model(rank)
        # forward only: the last stage's output is the reference model's
        full = make_model()
        stage = PipelineStage(full[CUTS[2][rank] : CUTS[2][rank + 1]])
        out = ScheduleGPipe(stage, 4, F.mse_loss).eval(batch(0, 8)[0])
        if rank == 1:
            torch.testing.assert_close(out, make_model()(batch(0, 8)[0]).detach(), **TOL)
        assert all(p.grad is None for p in full.parameters())
        # set-up runs the module on the meta device: buffers and RNG state as if it had not run
        bn = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)) if rank == 0 else nn.Linear(16, 4)
        params = [id(p) for p in bn.parameters()]
        rng = torch.random.get_rng_state()
        ScheduleGPipe(PipelineStage(bn), 4, F.mse_loss).eval(batch(0, 8)[0])
        assert torch.equal(rng, torch.random.get_rng_state())
        assert params == [id(p) for p in bn.parameters()] and all(p.device.type == "cpu" for p in bn.parameters())
        if rank == 0:
            assert int(bn[1].num_batches_tracked) == 4  # the four micro-batches, not the set-up
    dist.destroy_process_group()
    return done, msgs


def job_world4(rank, world, schedule_name):
    """4 stages, and 2 stages x 2 data-parallel replicas, from one world of 4 ranks; then stage 1
    of a 4-stage pipeline dies in the middle of a step (see _dead_stage)."""
    from fairscale_c.nn.pipe import Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    done = []
    for cls in (ScheduleGPipe, Schedule1F1B):
        done.append(_train_and_compare(rank, None, 4, cls, 4, 8))
    done.append(_train_interleaved(rank, 4, 2, 8))
    done.append(_train_interleaved(rank, 4, 2, 5, looped=True))
    done.append(_train_interleaved(rank, 4, 2, 8, edge_groups=True))
    # pipeline groups {0,1}, {2,3}; data-parallel groups {0,2}, {1,3} (every rank makes every group)
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage_index = divmod(rank, 2)
    for cls in (ScheduleGPipe, Schedule1F1B):
        done.append(
            "2x2 " + _train_and_compare(stage_index, pp[replica], 2, cls, 4, 8, dp=(replica, 2, dp[stage_index]))
        )
    return done, _dead_stage(rank, schedule_name)


def job_world3_edges(rank, world):
    """3 ranks: the CUDA layout's groups have a class of their own for the edge across the wrap."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return [
        _train_interleaved(rank, 3, 2, 6, edge_groups=True),
        _train_interleaved(rank, 3, 2, 4, looped=True, edge_groups=True),
    ]


class _FailAt(nn.Module):
    """At its `at`-th forward (counting set-up's): exits the process without clean-up
    (``raises=None``), or raises ValueError(raises) and works again afterwards."""

    def __init__(self, inner: nn.Module, at: int, raises: Optional[str] = None) -> None:
        super().__init__()
        self.inner, self.at, self.raises, self.calls = inner, at, raises, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            if self.raises is None:
                os._exit(7)
            raise ValueError(self.raises)
        return self.inner(x)


def _dead_stage(rank, schedule_name):
    """Stage 1 of 4 dies in the middle of the second step; the others must raise DistributedError.
    The pipeline runs on a new group built with FAIRSCALE_C_TIMEOUT=DEAD_TIMEOUT_S."""
    from fairscale_c import DistributedError
    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe

    os.environ["FAIRSCALE_C_TIMEOUT"] = str(DEAD_TIMEOUT_S)  # read when the engine group is built
    n_micro = 4
    mod = make_model()[CUTS[4][rank] : CUTS[4][rank + 1]]
    if rank == 1:
        mod = _FailAt(mod, n_micro + 3)  # step 1, micro-batch 2
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(PipelineStage(mod, group=dist.new_group([0, 1, 2, 3])), n_micro, F.mse_loss)
    _first_step(schedule)
    x, y = batch(1, 8)
    t0 = time.monotonic()
    try:
        schedule.step(x, target=y)
    except DistributedError as e:
        return "DistributedError", str(e), time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "nothing", "", time.monotonic() - t0


class _Route(nn.Module):
    """Uses layer a or layer b, depending on the sign of the batch: replicas fed data of
    different signs use different parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if bool(x.mean() > 0) else self.b(x)


class _Cache(nn.Module):
    """Builds a table on its first forward, on the input's device (set-up's shape inference must
    not leave a meta tensor behind)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.fc, self.table = nn.Linear(8, 4), None

    def forward(self, x):
        if self.table is None:
            self.table = torch.linspace(0, 1, 4, device=x.device, dtype=x.dtype)
        return self.fc(x) + self.table


def _routed_gradients(rank, pp, dp):
    """2 stages x 2 replicas; stage 0 of replica 0 uses only layer a, of replica 1 only layer b.
    The average over the data-parallel group must give each layer half its replica's gradient
    on both replicas (a layer's gradient is not added to the other's)."""
    from fairscale_c.nn.pipe import PipelineStage, ScheduleGPipe

    replica, stage_index = divmod(rank, 2)
    torch.manual_seed(1)
    last = nn.Linear(8, 4)
    mod = _Route() if stage_index == 0 else copy.deepcopy(last)
    schedule = ScheduleGPipe(
        PipelineStage(mod, stage_index, 2, group=pp[replica]), 1, F.mse_loss, dp_group=dp[stage_index]
    )
    x, y = batch(9, 4)
    xs = [x.abs(), -x.abs()]
    schedule.step(xs[replica], target=y)
    ref0, ref1 = _Route(), copy.deepcopy(last)
    for xx in xs:
        F.mse_loss(ref1(ref0(xx)), y).backward()
    want = ref0 if stage_index == 0 else ref1
    return [not_close(p.grad, q.grad / 2) for p, q in zip(mod.parameters(), want.parameters())]


def job_stage_raises(rank, world):
    """2 stages x 2 replicas; stage 1 of replica 0 (rank 1) raises in the middle of step 1 and
    carries on. Every rank's step must raise at once, not at FAIRSCALE_C_TIMEOUT: rank 0 through
    the pipeline group, rank 3 through the data-parallel group it waits on, rank 2 through its
    data-parallel group with rank 0; and rank 1's next step must not take its peers' messages."""
    from fairscale_c import DistributedError
    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    routed = _routed_gradients(rank, pp, dp)
    replica, stage_index = divmod(rank, 2)
    mod = make_model()[CUTS[2][stage_index] : CUTS[2][stage_index + 1]]
    if rank == 1:
        mod = _FailAt(mod, 4 + 3, "stage 1 of replica 0 raised")  # step 0: 4 calls; step 1, micro-batch 2
    schedule = Schedule1F1B(
        PipelineStage(mod, stage_index, 2, group=pp[replica]), 4, F.mse_loss, dp_group=dp[stage_index]
    )
    _first_step(schedule)
    got = []
    for step in (1, 2):
        x, y = batch(step, 8)
        t0 = time.monotonic()
        try:
            schedule.step(x, target=y)
            got.append(("nothing", "", 0.0))
        except DistributedError as e:
            got.append(("DistributedError", str(e), time.monotonic() - t0))
        except ValueError as e:
            got.append(("ValueError", str(e), time.monotonic() - t0))
    return routed, got


def job_cache(rank, world):
    """Stage 1 builds a table on its first forward; set-up's shape inference on the meta device
    must leave it unbuilt, so that the first step builds it on the CPU."""
    from fairscale_c.nn.pipe import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    first = nn.Linear(8, 8)
    mod = copy.deepcopy(first) if rank == 0 else _Cache()
    schedule = ScheduleGPipe(PipelineStage(mod, rank, 2), 2, F.mse_loss)
    x, y = batch(3, 6)
    out = schedule.step(x, target=torch.zeros(6, 4))
    if rank == 0:
        return None
    want = torch.cat([_Cache()(first(c)) for c in x.tensor_split(2)])
    return not_close(out, want.detach()), str(mod.table.device)


class _Autocast(nn.Module):
    """``inner`` with its forward under CPU bf16 autocast."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


def job_autocast(rank, world):
    """Stages under CPU bf16 autocast, around the step or inside each stage's forward: the stages
    send what autocast makes (bf16), and output and gradients are those of the same model run on
    the same micro-batches in one process under the same autocast."""
    from fairscale_c.nn.pipe import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n_micro, cuts = 2, CUTS[2]
    got = []
    for where in ("around the step", "inside the stages"):
        full = make_model()
        ref = copy.deepcopy(full)
        mod = full[cuts[rank] : cuts[rank + 1]]
        stage_mod = _Autocast(mod) if where == "inside the stages" else mod
        schedule = ScheduleGPipe(PipelineStage(stage_mod, rank, 2), n_micro, F.mse_loss)
        x, y = batch(0, 6)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "around the step"):
            out = schedule.step(x, target=y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_outs = [ref(c) for c in x.tensor_split(n_micro)]
            ref_loss = sum(F.mse_loss(o, t) for o, t in zip(ref_outs, y.tensor_split(n_micro))) / n_micro
        ref_loss.backward()
        if rank == 1:
            assert out.dtype is torch.bfloat16, (where, out.dtype)
            torch.testing.assert_close(out, torch.cat(ref_outs).detach(), atol=1e-2, rtol=1e-2)
        for p, q in zip(mod.parameters(), ref[cuts[rank] : cuts[rank + 1]].parameters()):
            assert p.grad.dtype is torch.float32
            torch.testing.assert_close(p.grad, q.grad, atol=1e-2, rtol=1e-2, msg=lambda m, w=where: f"{w}: {m}")
        got.append(where)
    return got


class _AddOne(nn.Module):
    def forward(self, x):
        return x.add_(1.0)


def job_inplace_first(rank, world):
    """Each stage begins with an in-place op that is not idempotent: stage 1's received
    activations (leaves that need a gradient) and stage 0's micro-batches (views of one batch)
    take it as plain torch does; outputs and gradients are those of the whole model on the same
    micro-batches."""
    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n_micro = 4
    for cls in (ScheduleGPipe, Schedule1F1B):
        torch.manual_seed(0)
        full = nn.Sequential(_AddOne(), nn.Linear(4, 4), _AddOne(), nn.Linear(4, 4))
        ref = copy.deepcopy(full)
        mod = full[2 * rank : 2 * rank + 2]
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
        out = cls(PipelineStage(mod, rank, 2), n_micro, F.mse_loss).step(x.clone(), target=y)
        ref_outs = [ref(c.clone()) for c in x.tensor_split(n_micro)]
        (sum(F.mse_loss(o, t) for o, t in zip(ref_outs, y.tensor_split(n_micro))) / n_micro).backward()
        if rank == 1:
            torch.testing.assert_close(out, torch.cat(ref_outs).detach())
        for p, q in zip(mod.parameters(), ref[2 * rank : 2 * rank + 2].parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, c=cls: f"{c.__name__}: {m}")
    return True


class _MaskedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        x = x.mul_(2.0)  # on the positional input, then on the keyword one: both in place
        mask = mask.clamp_(min=0.0)
        return torch.tanh(self.fc(x)) * mask[:, None]


def job_inplace_on_keyword_inputs(rank, world):
    """Stage 0 changes its positional and keyword inputs in place: the first step's set-up pass
    (which runs the module once to learn its outputs) leaves the caller's tensors alone, and the
    keyword micro-batches (views of one batch) are copied as the positional ones are."""
    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for cls in (ScheduleGPipe, Schedule1F1B):
        for n_micro in (1, 2):
            torch.manual_seed(0)
            head, tail = _MaskedHead(), nn.Linear(4, 3)
            ref_head, ref_tail = copy.deepcopy(head), copy.deepcopy(tail)
            mod = head if rank == 0 else tail
            g = torch.Generator().manual_seed(5)
            x, y, mask = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g), torch.randn(8, generator=g)
            x0, mask0 = x.clone(), mask.clone()
            cls(PipelineStage(mod, rank, 2), n_micro, F.mse_loss).step(x, target=y, mask=mask)
            parts = zip(x0.tensor_split(n_micro), mask0.tensor_split(n_micro), y.tensor_split(n_micro))
            ref_loss = sum(F.mse_loss(ref_tail(ref_head(a.clone(), mask=m.clone())), t) for a, m, t in parts) / n_micro
            ref_loss.backward()
            what = f"{cls.__name__}, {n_micro} micro-batches"
            for p, q in zip(mod.parameters(), (ref_head if rank == 0 else ref_tail).parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m, w=what: f"{w}: {m}")
    return True


# ------------------------------------------------------------------------------ tests


def test_stages_changing_positional_and_keyword_inputs_in_place():
    assert run_ranks(job_inplace_on_keyword_inputs, 2, timeout=120, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [True, True]


def test_stages_beginning_with_inplace_ops():
    assert run_ranks(job_inplace_first, 2, timeout=120, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [True, True]


def test_two_stages_match_single_process_and_reject_bad_input():
    before = orphaned_segments()
    results = run_ranks(job_world2, 2, "cpu", timeout=240, env={"FAIRSCALE_C_TIMEOUT": "60"})
    done, msgs = results[0]
    assert len(done) == 18, done
    assert results[0][1] == results[1][1], "set-up errors must be the same on every stage"
    assert len(msgs) == 6
    assert orphaned_segments() <= before


def test_three_ranks_on_the_cuda_layouts_groups():
    results = run_ranks(job_world3_edges, 3, timeout=180, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert [len(r) for r in results] == [2, 2, 2]


def test_a_stage_that_raises_makes_every_rank_raise_at_once():
    before = orphaned_segments()
    results = run_ranks(job_stage_raises, 4, timeout=240, env={"FAIRSCALE_C_TIMEOUT": "60"})
    routed = [r for r, _ in results]
    assert [len(r) for r in routed] == [4, 2, 4, 2] and not any(any(r) for r in routed), routed
    results = [got for _, got in results]
    (kind, msg, _), (kind2, msg2, _) = results[1]
    assert (kind, msg) == ("ValueError", "stage 1 of replica 0 raised"), results[1]
    assert kind2 == "DistributedError" and "this rank gave up" in msg2, results[1]
    for rank in (0, 2, 3):
        (kind, msg, seconds), (kind2, _, _) = results[rank]
        assert kind == kind2 == "DistributedError" and "gave up on the group" in msg, (rank, results[rank])
        assert seconds < 20, (rank, seconds, msg)  # the timeout is 60 s
    # both name rank 1's process: rank 1 of the pipeline group, rank 0 of the data-parallel one
    assert "[0,1]/pipeline' (rank 0 of 2): rank 1 (pid" in results[0][0][1], results[0]
    assert "[1,3]' (rank 1 of 2): rank 0 (pid" in results[3][0][1], results[3]
    pids = {re.search(r"\(pid (\d+)\)", results[r][0][1]).group(1) for r in (0, 3)}
    assert len(pids) == 1, results
    assert orphaned_segments() <= before


def test_stages_under_autocast():
    want = ["around the step", "inside the stages"]
    assert run_ranks(job_autocast, 2, timeout=120, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [want, want]


def test_a_module_that_caches_on_its_first_forward():
    assert run_ranks(job_cache, 2, timeout=120, env={"FAIRSCALE_C_TIMEOUT": "60"})[1] == ("", "cpu")


@pytest.mark.serial  # kills a rank; times how soon the others know
@pytest.mark.parametrize("schedule_name", ["1f1b"])
def test_four_stages_pipeline_by_data_parallel_and_a_killed_stage(schedule_name):
    """4 stages and 2 x 2 match the single process; then a stage killed mid-step makes every other
    stage raise DistributedError well within FAIRSCALE_C_TIMEOUT, leaving nothing in /dev/shm."""
    before = orphaned_segments()
    results = run_ranks(job_world4, 4, schedule_name, timeout=240, may_die=[1], env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert results[1] is None  # the killed stage
    for rank in (0, 2, 3):
        done, (kind, msg, seconds) = results[rank]
        assert len(done) == 7, done
        assert kind == "DistributedError", (rank, kind, msg)
        # the dead stage's neighbours see its exit; stage 3 sees stage 2 give up and exit, or times out
        assert seconds < DEAD_TIMEOUT_S + 5, (rank, seconds, msg)
        if rank != 3:
            assert "rank 1 (pid" in msg and "exited" in msg, msg
            assert seconds < DEAD_TIMEOUT_S, (rank, seconds, msg)
    assert orphaned_segments() <= before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_stages_on_cuda_match_single_process():
    """The world-2 numerics on NCCL: two GPUs, or one shared by both ranks with NCCL >= 2.30."""
    from test_cuda import _nccl_devices  # skips when two ranks can neither have a GPU each nor share one

    _, nccl_env = _nccl_devices()
    env = {"FAIRSCALE_C_TIMEOUT": "120", **nccl_env}
    results = run_ranks(job_world2, 2, "cuda", timeout=300, env=env)
    assert len(results[0][0]) == 14


def job_large_messages(rank, world):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    # 8 micro-batches of 1024 x 1024 fp32: 4 MiB messages, more than NCCL completes without the receive
    return [_train_interleaved(rank, 2, 2, 8, "cuda", batch_size=8192, looped=looped, width=1024) for looped in (0, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_multi_stage_schedules_on_cuda_with_large_messages():
    """Interleaved 1F1B and looped BFS send micro-batches ahead; with 3 MiB messages and both
    directions on one communicator they hung on an H200 (docs/gpu.md). Equal to single-process
    training, within the timeout."""
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    results = run_ranks(job_large_messages, 2, timeout=240, env={"FAIRSCALE_C_TIMEOUT": "60", **nccl_env})
    assert [len(r) for r in results] == [2, 2]


def test_tensor_chunk_spec_helpers_match_torchs():
    from torch.distributed.pipelining.microbatch import TensorChunkSpec as TorchSpec

    from fairscale_c.nn.pipe import TensorChunkSpec as Spec

    ours, theirs = Spec.from_tuple((0, 1)), TorchSpec.from_tuple((0, 1))
    assert isinstance(ours, tuple) and [s.split_dim for s in ours] == [s.split_dim for s in theirs] == [0, 1]
    ours_d, theirs_d = Spec.from_dict({"ids": 0, "mask": 1}), TorchSpec.from_dict({"ids": 0, "mask": 1})
    assert {k: s.split_dim for k, s in ours_d.items()} == {k: s.split_dim for k, s in theirs_d.items()}
    assert Spec(1) == Spec(1) and Spec(1) != Spec(0) and Spec(0) != 0 and len({Spec(2), Spec(2), Spec(3)}) == 2
    assert repr(Spec(-1)) == "TensorChunkSpec(-1)"
    for bad in ("0", 1.0, True, None):
        with pytest.raises(TypeError, match="split_dim must be an int"):
            Spec(bad)


def test_input_args_descriptions_and_what_may_pass_between_stages():
    from fairscale_c.nn.pipe.stage import TensorMeta, _check_passable, metas_of

    what = "PipelineStage: input_args"
    f32 = torch.get_default_dtype()
    assert metas_of(torch.empty(2, 3, dtype=torch.float16), what) == (TensorMeta((2, 3), torch.float16),)
    assert metas_of((4, 5), what) == (TensorMeta((4, 5), f32),)  # a shape, not two tensors
    assert metas_of((), what) == (TensorMeta((), f32),)  # the shape of a scalar
    assert metas_of([torch.Size([1]), torch.empty(0, device="meta")], what) == (
        TensorMeta((1,), f32),
        TensorMeta((0,), f32),
    )
    for bad, err, text in (
        ("x", TypeError, "must be a Tensor, a shape, or a non-empty tuple of them, got str"),
        ((torch.empty(1), "x"), TypeError, r"input_args\[1\] must be a Tensor or a shape"),
        (((2, -1),), ValueError, r"input_args\[0\]: shape \(2, -1\) has a negative dimension"),
    ):
        with pytest.raises(err, match=text):
            metas_of(bad, what)
    ok = [TensorMeta((2, 3), torch.float32), TensorMeta((2,), torch.int64)]
    assert _check_passable(ok, "outputs") == ""
    assert "at most 8 may pass" in _check_passable([ok[0]] * 9, "outputs")
    assert "outputs[1] has dtype torch.complex64" in _check_passable(
        [ok[0], TensorMeta((1,), torch.complex64)], "outputs"
    )
    assert "outputs[0] has 9 dimensions; at most 8" in _check_passable([TensorMeta((1,) * 9, torch.float32)], "outputs")


def test_looped_bfs_order_is_torchs():
    """ScheduleLoopedBFS runs a rank's actions in the order of torch.distributed.pipelining's
    ScheduleLoopedBFS (its _calculate_single_rank_operations, without the idle padding): every
    micro-batch forward stage by stage, then the backwards of the stages in reverse, micro-batches
    in reverse."""
    import types

    from fairscale_c.nn.pipe import ScheduleLoopedBFS

    fake = types.SimpleNamespace(_stages=[None, None], _n_microbatches=3)
    got = [str(a) for a in ScheduleLoopedBFS.order(fake)]
    assert got == ["F0", "F1", "F2", "F0@1", "F1@1", "F2@1", "B2@1", "B1@1", "B0@1", "B2", "B1", "B0"]
    assert [str(a) for a in ScheduleLoopedBFS.order(fake, has_backward=False)] == got[:6]


class _RouteWithUnused(_Route):
    """_Route with a layer c that no replica ever uses."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(8, 8)


def job_unused_by_every_replica(rank, world):
    """One-stage pipelines on two data-parallel replicas: replica 0 uses layer a, replica 1 layer
    b, neither uses c. As DDP (find_unused_parameters) and torch give it, c keeps no gradient,
    and a and b get their replica's gradient averaged with the other's zero."""
    from fairscale_c.nn.pipe import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        pp = [dist.new_group([0]), dist.new_group([1])]
        mod = _RouteWithUnused()
        schedule = ScheduleGPipe(PipelineStage(mod, 0, 1, group=pp[rank]), 2, F.mse_loss, dp_group=dist.group.WORLD)
        x, y = batch(11, 4)
        y = y.repeat(1, 2)
        xs = [x.abs(), -x.abs()]
        schedule.step(xs[rank], target=y)
        ref = _RouteWithUnused()
        for xx in xs:
            F.mse_loss(ref(xx), y).backward()
        out = {}
        for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
            if q.grad is None:
                out[name] = None if p.grad is None else "has a gradient"
            else:
                out[name] = "no gradient" if p.grad is None else not_close(p.grad, q.grad / 2)
        return out
    finally:
        dist.destroy_process_group()


def test_a_parameter_no_replica_uses_keeps_no_gradient():
    results = run_ranks(job_unused_by_every_replica, 2, timeout=120, env={"FAIRSCALE_C_TIMEOUT": "60"})
    want = {"a.weight": "", "a.bias": "", "b.weight": "", "b.bias": "", "c.weight": None, "c.bias": None}
    assert results == [want, want], results


def _one_f_one_b(p, s, m):
    """The 1F1B order of stage s of p, written out: p - s - 1 warm-up forwards (at most m), then
    a forward and the oldest backward in turn, then the backwards left."""
    warm = min(p - s - 1, m)
    order = [f"F{i}" for i in range(warm)]
    for i in range(m - warm):
        order += [f"F{warm + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - warm, m)]


def test_one_f_one_b_order():
    """Schedule1F1B.order(): the 1F1B order, and at most p - s micro-batches in flight on stage s
    (exactly that many at the peak when m >= p - s), as its docstring says."""
    import types

    from fairscale_c.nn.pipe import Schedule1F1B

    def order(p, s, m, has_backward=True):
        stage = types.SimpleNamespace(num_stages=p, stage_index=s)
        fake = types.SimpleNamespace(_stages=[stage], _n_microbatches=m)
        return [str(a) for a in Schedule1F1B.order(fake, has_backward)]

    assert order(2, 0, 4) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert order(2, 1, 4) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert order(4, 0, 4) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert order(4, 1, 4) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    for p in (2, 4):
        for m in (4, 8):
            for s in range(p):
                got = order(p, s, m)
                assert got == _one_f_one_b(p, s, m), (p, s, m, got)
                assert order(p, s, m, has_backward=False) == [f"F{i}" for i in range(m)]
                in_flight, peak = 0, 0
                for a in got:
                    in_flight += 1 if a[0] == "F" else -1
                    peak = max(peak, in_flight)
                assert in_flight == 0 and peak == min(p - s, m), (p, s, m, peak)


class _Warns(nn.Module):
    """A layer that warns once per forward it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        import warnings

        warnings.warn("forward ran", UserWarning, stacklevel=2)
        return self.lin(x)


def job_setup_pass_is_silent(rank, world):
    """The stage's set-up pass (shapes worked out on the meta device, or a real run) is not a
    forward of the user's: their module's warnings come once per micro-batch forward."""
    import warnings

    from fairscale_c.nn.pipe import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        mod = _Warns() if rank == 0 else nn.Linear(8, 4)
        schedule = ScheduleGPipe(PipelineStage(mod, rank, 2), 2, F.mse_loss)
        x, y = batch(12, 4)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            schedule.step(x if rank == 0 else None, target=y if rank == 1 else None)
        return sum(str(w.message) == "forward ran" for w in seen)
    finally:
        dist.destroy_process_group()


def test_the_set_up_pass_gives_no_warnings_of_the_module():
    assert run_ranks(job_setup_pass_is_silent, 2, timeout=120, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [2, 0]


def test_a_device_that_is_no_device_names_the_argument():
    from fairscale_c.nn.pipe import PipelineStage

    with pytest.raises(ValueError, match="PipelineStage: argument 'device' is not a device: 'foo'"):
        PipelineStage(nn.Linear(2, 2), device="foo")
