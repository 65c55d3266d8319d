"""FSDP scenarios run inside spawned ranks; each compares against single-process PyTorch.

Every rank builds the same seeded model, keeps an unwrapped deep copy as the reference, trains
the FSDP copy on its slice of each global batch and the reference on the whole global batch,
and checks losses and final parameters. Tolerances: fp32 atol 1e-5; bf16 (mixed precision or
autocast) atol/rtol 3e-2, since bf16 keeps 8 bits of mantissa.
"""

import copy
import dataclasses
import functools
import itertools
import os
import re
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
FP16_TOL = dict(atol=1e-2, rtol=1e-2)
LOCAL_BATCH = 4
STEPS = 3
# The numerics scenarios run on this device: "cpu", or "cuda" (each rank on GPU rank % count),
# chosen by the spawning test through FAIRSCALE_C_TEST_DEVICE.
DEVICE = {"device": torch.device("cpu")}


# ------------------------------------------------------------------------------------ models


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=16, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = 2

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A GPT-style model whose output projection is tied to the input embedding."""

    def __init__(self, vocab=32, d=16, n_layers=2, seq=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class TwiceModel(nn.Module):
    """Runs one (separately wrapped) submodule twice in a forward (FairScale issue 617)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = F.relu(self.shared(h))
        h = F.relu(self.shared(h))
        return self.out(h)


# ------------------------------------------------------------------------------------ data


def mlp_batch(step, world, gen):
    x = torch.randn(world * LOCAL_BATCH, 8, generator=gen)
    y = torch.randn(world * LOCAL_BATCH, 4, generator=gen)
    return x, y


def lm_batch(step, world, gen):
    idx = torch.randint(0, 32, (world * LOCAL_BATCH, 8), generator=gen)
    return idx, torch.roll(idx, -1, dims=1)


def mse(model, x, y):
    return F.mse_loss(model(x).float(), y)


def xent(model, idx, tgt):
    logits = model(idx).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


# ------------------------------------------------------------------------------------ harness


def _local(t, rank):
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def train_and_compare(
    rank,
    world,
    make_model,
    wrap,
    batch_fn=mlp_batch,
    loss_fn=mse,
    tol=FP32_TOL,
    micro_batches=1,
    autocast=False,
    steps=STEPS,
    freeze=None,
):
    """Train FSDP(model) and the plain model side by side; assert losses and parameters match."""
    from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP

    device = DEVICE["device"]
    torch.manual_seed(0)
    model = make_model().to(device)
    if freeze:
        for name, p in model.named_parameters():
            if name.startswith(freeze):
                p.requires_grad_(False)
    ref = copy.deepcopy(model)
    fsdp = wrap(model)
    assert isinstance(fsdp, FSDP)
    # SGD with momentum: Adam divides by sqrt(v), which turns the rounding noise of gradients that
    # are zero in exact arithmetic (e.g. attention key biases) into full-size steps.
    opt = torch.optim.SGD([p for p in fsdp.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234)
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else (lambda: _nullcontext())
    for step in range(steps):
        batches = [tuple(t.to(device) for t in batch_fn(step, world, gen)) for _ in range(micro_batches)]
        for j, (x, y) in enumerate(batches):
            sync = j == micro_batches - 1
            with _nullcontext() if sync else fsdp.no_sync(), ctx():
                loss = loss_fn(fsdp, _local(x, rank), _local(y, rank)) / micro_batches
            loss.backward()
            with ctx():
                ref_local = loss_fn(ref, _local(x, rank), _local(y, rank)) / micro_batches
            torch.testing.assert_close(loss.detach(), ref_local.detach(), **tol, msg=f"loss at step {step}.{j}")
            with ctx():
                ref_loss = loss_fn(ref, x, y) / micro_batches
            ref_loss.backward()
        fsdp.clip_grad_norm_(1.0)
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    sd = fsdp.state_dict()
    ref_sd = ref.state_dict()
    assert list(sd.keys()) == list(ref_sd.keys()), (list(sd.keys()), list(ref_sd.keys()))
    for k, v in ref_sd.items():
        torch.testing.assert_close(sd[k], v, **tol, msg=f"parameter {k} after {steps} steps")
    if freeze:
        frozen = {k: v for k, v in ref_sd.items() if k.startswith(freeze)}
        assert frozen and all(torch.equal(sd[k], v) for k, v in frozen.items())
    return fsdp


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ------------------------------------------------------------------------------------ scenarios


def fsdp(**kw):
    from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP

    return functools.partial(FSDP, **kw)


def nested_auto_wrap(model, **kw):
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap

    # Blocks (~3.3k parameters) get their own instance; the tied embedding/head (512) stay in the root.
    policy = functools.partial(default_auto_wrap_policy, min_num_params=1000)
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=policy, **kw):
        return FSDP(auto_wrap(model), **kw)


def nested_manual_wrap(model, **kw):
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn.wrap import enable_wrap, wrap

    with enable_wrap(wrapper_cls=FSDP, **kw):
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = wrap(blk)
        return FSDP(model, **kw)


def scenario_mlp(rank, world):
    train_and_compare(rank, world, MLP, fsdp())


def scenario_mlp_no_reshard(rank, world):
    train_and_compare(rank, world, MLP, fsdp(reshard_after_forward=False))


def scenario_transformer_tied(rank, world):
    m = train_and_compare(rank, world, TinyLM, fsdp(), batch_fn=lm_batch, loss_fn=xent)
    meta = m.local_metadata_dict()["param_metadata"][0]
    assert ("embed.weight", "head.weight") in meta["shared_param_info"], meta["shared_param_info"]


def scenario_transformer_auto_wrap(rank, world):
    m = train_and_compare(rank, world, TinyLM, nested_auto_wrap, batch_fn=lm_batch, loss_fn=xent)
    assert len([1 for _ in m.local_metadata_dict()["param_metadata"]]) > 1


def scenario_transformer_manual_wrap_reshard(rank, world):
    for reshard in (True, False):
        wrap = functools.partial(nested_manual_wrap, reshard_after_forward=reshard)
        train_and_compare(rank, world, TinyLM, wrap, batch_fn=lm_batch, loss_fn=xent)


def scenario_bf16_mixed_precision(rank, world):
    for fp32_rs in (False, True):
        wrap = functools.partial(
            nested_manual_wrap, mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=fp32_rs
        )
        train_and_compare(rank, world, TinyLM, wrap, batch_fn=lm_batch, loss_fn=xent, tol=BF16_TOL)


def scenario_fp16_mixed_precision(rank, world):
    # FairScale's default mixed precision: fp16 compute, fp32 master shards.
    wrap = functools.partial(nested_manual_wrap, mixed_precision=True)
    train_and_compare(rank, world, TinyLM, wrap, batch_fn=lm_batch, loss_fn=xent, tol=FP16_TOL)


def scenario_unflattened(rank, world):
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    m = train_and_compare(rank, world, MLP, fsdp(flatten_parameters=False))
    assert [n for n, _ in m.named_parameters()][0] == "fc1.weight"  # FairScale's clean names

    def wrap(model):  # an unflattened inner instance inside a flattened root
        model.shared = FSDP(model.shared, flatten_parameters=False)
        return FSDP(model)

    train_and_compare(rank, world, TwiceModel, wrap)


class Checkpointed(nn.Module):
    """Recomputes the block's forward in backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def scenario_activation_checkpointing(rank, world):
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    def make_model():  # the reference recomputes too
        model = TinyLM()
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(blk)
        return model

    def wrap(model):  # FSDP(checkpoint(block)) per block, as Tango-style trainers do
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = FSDP(blk)
        return FSDP(model)

    train_and_compare(rank, world, make_model, wrap, batch_fn=lm_batch, loss_fn=xent)


def scenario_checkpoint_wrapper(rank, world):
    # fairscale_c.nn.checkpoint_wrapper inside FSDP, as FairScale recommends and Tango's
    # with_wrapped_modules does (checkpoint_wrapper first, then FSDP), against the plain model;
    # then the other order, FSDP instances wrapped for checkpointing.
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn import checkpoint_wrapper

    def inside(model):
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = FSDP(checkpoint_wrapper(blk))
        return FSDP(model)

    train_and_compare(rank, world, TinyLM, inside, batch_fn=lm_batch, loss_fn=xent)

    def inside_unflattened(model):  # the recomputation reads unflattened parameters in place
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = FSDP(checkpoint_wrapper(blk), flatten_parameters=False)
        return FSDP(model)

    train_and_compare(rank, world, TinyLM, inside_unflattened, batch_fn=lm_batch, loss_fn=xent)

    def tied_head_inside(model):  # a checkpointed head that shares the embedding's instance's weight
        model.embed = FSDP(model.embed)
        model.head = FSDP(checkpoint_wrapper(model.head), flatten_parameters=False)
        return FSDP(model)

    train_and_compare(rank, world, TinyLM, tied_head_inside, batch_fn=lm_batch, loss_fn=xent)

    def outside(model):
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(FSDP(blk))
        return FSDP(model)

    train_and_compare(rank, world, TinyLM, outside, batch_fn=lm_batch, loss_fn=xent)


def scenario_bucketing(rank, world):
    # 0: every gradient reduce-scattered alone; 0.02 MiB (20 KiB): the blocks (13 KiB each) fill a
    # bucket that is sent in the middle of backward, the root (3 KiB) goes at the end; 0.01 MiB:
    # the blocks go alone while the root waits in a bucket; 25 MiB packs everything of these
    # models into one op, as every other scenario exercises.
    for cap in (0, 0.02, 0.01):
        wrap = functools.partial(nested_manual_wrap, bucket_cap_mb=cap)
        train_and_compare(rank, world, TinyLM, wrap, batch_fn=lm_batch, loss_fn=xent)


def scenario_move_params_to_cpu(rank, world):
    m = train_and_compare(rank, world, MLP, fsdp(move_params_to_cpu=True))
    assert m.move_grads_to_cpu and all(p.device.type == "cpu" for p in m.parameters())


def scenario_no_sync(rank, world):
    train_and_compare(rank, world, MLP, fsdp(), micro_batches=3)
    train_and_compare(rank, world, TinyLM, nested_manual_wrap, batch_fn=lm_batch, loss_fn=xent, micro_batches=2)


def scenario_frozen(rank, world):
    train_and_compare(rank, world, MLP, fsdp(), freeze="fc1.")
    train_and_compare(rank, world, TinyLM, nested_manual_wrap, batch_fn=lm_batch, loss_fn=xent, freeze="blocks.0.")


def scenario_autocast(rank, world):
    train_and_compare(
        rank, world, TinyLM, nested_manual_wrap, batch_fn=lm_batch, loss_fn=xent, autocast=True, tol=BF16_TOL
    )


def scenario_multiple_forwards_before_backward(rank, world):
    def two_forwards(model, x, y):
        half = x.shape[0] // 2
        return (mse(model, x[:half], y[:half]) + mse(model, x[half:], y[half:])) / 2

    train_and_compare(rank, world, MLP, fsdp(), loss_fn=two_forwards, tol=FP32_TOL)

    def two_lm_forwards(model, idx, tgt):  # nested instances reshard between the two forwards
        half = idx.shape[0] // 2
        return (xent(model, idx[:half], tgt[:half]) + xent(model, idx[half:], tgt[half:])) / 2

    train_and_compare(rank, world, TinyLM, nested_manual_wrap, batch_fn=lm_batch, loss_fn=two_lm_forwards)


def _wrapped_and_plain_lm(wrap):
    """TinyLM (seed 0) wrapped by `wrap` and an unwrapped copy, each with SGD + momentum."""
    torch.manual_seed(0)
    model = TinyLM().to(DEVICE["device"])
    ref = copy.deepcopy(model)
    model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    return model, ref, opt, ref_opt


def scenario_separate_backwards(rank, world):
    """Two forwards, then a backward for each loss (FairScale issues 918 and 920): the second
    backward re-gathers what the first resharded, and its reduced gradients add to the first's."""
    device = DEVICE["device"]
    for wrap in (fsdp(), nested_manual_wrap):
        model, ref, opt, ref_opt = _wrapped_and_plain_lm(wrap)
        gen = torch.Generator().manual_seed(3)
        for step in range(STEPS):
            x, y = (t.to(device) for t in lm_batch(step, world, gen))
            h = LOCAL_BATCH // 2
            xl, yl = _local(x, rank), _local(y, rank)
            first, second = xent(model, xl[:h], yl[:h]) / 2, xent(model, xl[h:], yl[h:]) / 2
            first.backward()
            second.backward()
            ref_loss = 0
            for r in range(world):  # the same split on every rank's slice of the global batch
                xr, yr = _local(x, r), _local(y, r)
                ref_loss = ref_loss + (xent(ref, xr[:h], yr[:h]) + xent(ref, xr[h:], yr[h:])) / (2 * world)
            ref_loss.backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        sd = model.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=f"parameter {k} after {STEPS} steps")


def scenario_submodule_twice(rank, world):
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    def wrap(model):
        model.shared = FSDP(model.shared)
        return FSDP(model)

    train_and_compare(rank, world, TwiceModel, wrap)


def scenario_reduce_scatter_groups(rank, world):
    # FairScale's rule for process_group_reduce_scatter: a group of its own by default, the main
    # group for ProcessGroupName.default, a user group with the same ranks, the main group otherwise.
    from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP
    from fairscale_c.nn.data_parallel import ProcessGroupName, get_fsdp_instances

    import fairscale_c.distributed as fdist

    m = train_and_compare(rank, world, TinyLM, nested_manual_wrap, batch_fn=lm_batch, loss_fn=xent)
    # beyond FairScale: CUDA ranks sharing one GPU keep one communicator (the shared-GPU guard)
    shared_gpu = m.compute_device.type == "cuda" and fdist.ranks_share_gpus(m.comm)
    assert (m.comm_rs is not m.comm) == (world > 1 and not shared_gpu)
    assert all(i.comm_rs is m.comm_rs for i in get_fsdp_instances(m)), "one cached group"
    m = train_and_compare(rank, world, MLP, fsdp(process_group_reduce_scatter=ProcessGroupName.default))
    assert m.comm_rs is m.comm
    same = dist.new_group(list(range(world)))
    m = train_and_compare(rank, world, MLP, fsdp(process_group_reduce_scatter=same))
    assert m.process_group_reduce_scatter is (same if world > 1 else m.process_group)
    other = dist.new_group([0])  # a collective: every rank creates it
    m = FSDP(MLP().to(DEVICE["device"]), process_group_reduce_scatter=other)
    assert m.comm_rs is m.comm or world == 1  # ranks differ: falls back to process_group
    try:
        FSDP(MLP(), process_group_reduce_scatter="reduce-scatter")
    except ValueError as e:
        assert "process_group_reduce_scatter" in str(e)
    else:
        raise AssertionError("a string that is not a ProcessGroupName must be refused")


def scenario_half_after_wrapping(rank, world):
    # FairScale's _apply hook: .half() on a wrapped fp32 model switches it to pure fp16 (the
    # reference is the same model in fp16; SGD runs in fp16 on both sides).
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    def half_lm():
        return TinyLM().half()

    def wrap(model):
        model.float()  # fp16 -> fp32 is exact, so the shards equal the reference after .half()
        model.blocks[0] = FSDP(model.blocks[0])
        return FSDP(model).half()

    m = train_and_compare(rank, world, half_lm, wrap, batch_fn=lm_batch, loss_fn=xent, tol=FP16_TOL)
    assert m.compute_dtype is torch.float16 and m.flat_param_0.dtype is torch.float16


def _sharded_grad_scaler(rank, world, fused):
    # FSDP with ShardedGradScaler against the unwrapped model with torch's GradScaler on the whole
    # batch: same losses, parameters and scale, including a step whose gradients overflow (on one
    # rank's shard alone, so both sides must skip it and back off) and scale growth
    # (growth_interval=2). `fused`: AdamW(fused=True), which unscales inside its own step, so the
    # scaler checks for infs without unscale_ and the flag must still be agreed over the group;
    # else SGD with unscale_ and clipping.
    from fairscale_c.optim.grad_scaler import ShardedGradScaler

    device = DEVICE["device"]
    torch.manual_seed(0)
    model = MLP().to(device)
    ref = copy.deepcopy(model)
    fsdp_model = fsdp()(model)
    if fused:
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01, fused=True) for m in (fsdp_model, ref))
    else:
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (fsdp_model, ref))
    scaler = ShardedGradScaler(init_scale=2.0**10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    gen = torch.Generator().manual_seed(1234)
    for step in range(5):
        x, y = (t.to(device) for t in mlp_batch(step, world, gen))
        local_x = _local(x, rank).clone()
        if step == 2:
            x[-1, 0] = float("inf")  # the reference overflows; FSDP below, on the last rank alone
        ref_clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(ref.parameters()))
        for sc, o, loss, clip in (
            (scaler, opt, mse(fsdp_model, local_x, _local(y, rank)), fsdp_model.clip_grad_norm_),
            (ref_scaler, ref_opt, mse(ref, x, y), ref_clip),
        ):
            sc.scale(loss).backward()
            if step == 2 and sc is scaler and rank == world - 1:
                fsdp_model.flat_param_0.grad[0] = float("inf")  # after the reduce-scatter: one shard only
            if not fused:
                sc.unscale_(o)
                clip(1.0)
            sc.step(o)
            sc.update()
            o.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale(), ref_scaler.get_scale())
    assert scaler.get_scale() == 2.0**11  # grew at step 1, backed off at step 2, grew again at step 4
    sd, ref_sd = fsdp_model.state_dict(), ref.state_dict()
    for k, v in ref_sd.items():
        torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=f"parameter {k}")


def scenario_sharded_grad_scaler(rank, world):
    _sharded_grad_scaler(rank, world, fused=False)


def scenario_sharded_grad_scaler_fused(rank, world):
    _sharded_grad_scaler(rank, world, fused=True)


def scenario_requires_grad_changed(rank, world):
    # A block frozen after wrapping (step 1) and unfrozen again (step 3): FSDP follows the flag at
    # every forward as FairScale does, so it trains exactly what the unwrapped model trains.
    device = DEVICE["device"]
    fsdp_model, ref, opt, ref_opt = _wrapped_and_plain_lm(nested_manual_wrap)
    gen = torch.Generator().manual_seed(1234)
    for step in range(5):
        if step in (1, 3):
            fsdp_model.module.blocks[0].requires_grad_(step == 3)
            ref.blocks[0].requires_grad_(step == 3)
        idx, tgt = (t.to(device) for t in lm_batch(step, world, gen))
        loss = xent(fsdp_model, _local(idx, rank), _local(tgt, rank))
        loss.backward()
        xent(ref, idx, tgt).backward()
        frozen = [p.grad is None for p in fsdp_model.module.blocks[0].parameters()]
        assert frozen == [step in (1, 2)] * len(frozen), (step, frozen)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    sd, ref_sd = fsdp_model.state_dict(), ref.state_dict()
    for k, v in ref_sd.items():
        torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=f"parameter {k}")


NUMERICS = {name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")}
SCENARIOS = dict(NUMERICS)


# ------------------------------------------------------------------------------------ entry


def worker(rank, world, init_file, names, result_dir, ckpt_dir=None):
    from fairscale_c import DistributedError

    CKPT["dir"] = ckpt_dir
    os.environ.setdefault("FAIRSCALE_C_TIMEOUT", "60")
    torch.set_num_threads(1)
    if os.environ.get("FAIRSCALE_C_TEST_DEVICE") == "cuda":
        DEVICE["device"] = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE["device"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    failures = []
    try:
        for name in names:
            try:
                SCENARIOS[name](rank, world)
            except Exception as e:
                failures.append(f"[{name}] rank {rank}:\n{traceback.format_exc()}")
                if isinstance(e, DistributedError):
                    break  # the group is broken; later scenarios would only time out
    finally:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(failures))
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ checkpoints

CKPT = {"dir": None}
FIXED_INPUT_SEED = 99


def _atomic_save(obj, path):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _fixed_input():
    return torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(FIXED_INPUT_SEED))


def _trained_lm(rank, world, steps=2):
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = nested_manual_wrap(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        x, y = lm_batch(step, world, gen)
        xent(model, _local(x, rank), _local(y, rank)).backward()
        opt.step()
        opt.zero_grad()
    assert isinstance(model, FSDP)
    return model, opt


def state_save(rank, world):
    """Train at this world size and write full / local / optimizer state plus a reference output."""
    d = CKPT["dir"]
    model, opt = _trained_lm(rank, world)
    full = model.state_dict()
    model.state_dict_on_rank_0_only = True
    only0 = model.state_dict()
    assert (list(only0) == list(full)) if rank == 0 else (only0 == {}), list(only0)
    model.state_dict_on_rank_0_only = False
    with torch.no_grad():
        out = model(_fixed_input())
    local = model.local_state_dict()
    meta = model.local_metadata_dict()
    _atomic_save({"weights": local, "metadata": meta}, os.path.join(d, f"rank{rank}_local.pt"))
    full_osd = model.gather_full_optim_state_dict(opt)
    if rank == 0:
        assert full_osd is not None and len(full_osd["state"]) == len(full_osd["param_id_map"])
        _atomic_save(full, os.path.join(d, "full.pt"))
        _atomic_save(out, os.path.join(d, "out.pt"))
        _atomic_save(full_osd, os.path.join(d, "optim_full.pt"))
    else:
        assert full_osd is None
    # Round trip: this rank's shard of the gathered state equals what the optimizer holds.
    obj = [full_osd]
    dist.broadcast_object_list(obj, src=0)
    shard = model.get_shard_from_optim_state_dict(copy.deepcopy(obj[0]))
    mine = opt.state_dict()
    assert sorted(shard["state"]) == sorted(mine["state"]), (sorted(shard["state"]), sorted(mine["state"]))
    for pid, st in mine["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(shard["state"][pid][k], v, atol=0, rtol=0, msg=f"optim state {pid}.{k}")
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(shard)


def state_errors(rank, world):
    """Bad input to the state-dict and optimizer-state methods: a clear exception on every rank
    (the same on all, before any collective), and the model and optimizer untouched."""
    model, opt = _trained_lm(rank, world)
    before = {k: v.clone() for k, v in model.local_state_dict().items()}

    def raises(exc, text, fn, *args):
        try:
            fn(*args)
        except exc as e:
            assert re.search(text, str(e)), f"{exc.__name__} {e!s} does not match {text!r}"
        else:
            raise AssertionError(f"{fn.__name__} did not raise {exc.__name__} ({text})")

    grouped = torch.optim.AdamW([{"params": [p]} for p in model.parameters()], lr=1e-2)
    raises(ValueError, r"has \d+ parameter groups; FairScale.s format", model.gather_full_optim_state_dict, grouped)
    first = opt.param_groups[0]["params"][0]
    saved = opt.state[first]["exp_avg"]
    opt.state[first]["exp_avg"] = saved[:-1]  # one element short, on every rank alike
    raises(
        ValueError,
        r"state 'exp_avg' of flat parameter 0 has \d+ elements, expected the shard's \d+",
        model.gather_full_optim_state_dict,
        opt,
    )
    opt.state[first]["exp_avg"] = saved
    raises(
        ValueError, "has no 'param_id_map'", model.get_shard_from_optim_state_dict, {"state": {}, "param_groups": []}
    )
    local = model.local_state_dict()
    key = next(iter(before))
    raises(TypeError, f"'{key}' is a list; expected a tensor", model.load_local_state_dict, {**local, key: [1.0]})
    raises(
        TypeError,
        f"'{key}' is torch.float64 but this rank's shard is torch.float32",
        model.load_local_state_dict,
        {**local, key: local[key].double()},
    )
    for k, v in model.local_state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused load"
    assert model.gather_full_optim_state_dict(opt) is not None or rank != 0  # still works


def state_load(rank, world):
    """Load the full state saved at another world size; outputs must be identical."""
    d = CKPT["dir"]
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    model = nested_manual_wrap(TinyLM())
    model.load_state_dict(torch.load(os.path.join(d, "full.pt")))
    with torch.no_grad():
        out = model(_fixed_input())
    torch.testing.assert_close(out, torch.load(os.path.join(d, "out.pt")), **FP32_TOL)
    saved = torch.load(os.path.join(d, "rank0_local.pt"))
    if world != 2:
        try:
            model.load_local_state_dict(saved["weights"])
        except ValueError as e:
            assert "world size" in str(e), e
        else:
            raise AssertionError("load_local_state_dict from another world size did not raise")
    else:
        mine = torch.load(os.path.join(d, f"rank{rank}_local.pt"))
        model.load_local_state_dict(mine["weights"])
        with torch.no_grad():
            torch.testing.assert_close(model(_fixed_input()), torch.load(os.path.join(d, "out.pt")), **FP32_TOL)


def memory_per_rank(rank, world):
    """Parameters + gradients + optimizer state held per rank are 1/world of the total (+ padding)."""
    from fairscale_c.nn.data_parallel import get_fsdp_instances

    model, opt = _trained_lm(rank, world, steps=1)
    x, y = lm_batch(0, world, torch.Generator().manual_seed(0))
    xent(model, _local(x, rank), _local(y, rank)).backward()
    held = 0
    for p in model.parameters():
        held += p.numel() * p.element_size()
        held += p.grad.numel() * p.grad.element_size()
        for v in opt.state[p].values():
            if torch.is_tensor(v) and v.dim() > 0:
                held += v.numel() * v.element_size()
    total_params = sum(p.numel() for p in TinyLM().parameters())  # tied weight counted once
    padding = sum(h.layout.padding for m in get_fsdp_instances(model) for h in m._handles)
    bound = 4 * 4 * (total_params / world + padding)  # param, grad, exp_avg, exp_avg_sq in fp32
    assert held <= bound, (held, bound)
    # Full parameters and their gradients are released after backward.
    for m in get_fsdp_instances(model):
        for h in m._handles:
            assert h.full.untyped_storage().size() == 0 and h.full.grad is None


class TangoFixture(nn.Module):
    """The model of Tango's FairScale test fixture: 3 x [Linear(4, 4) + ReLU] blocks, Linear(4, 1),
    MSE loss, called with keyword arguments and returning {"loss": ...}."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(4, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return {"loss": F.mse_loss(self.head(x).float().squeeze(-1), y)}


def _tango_build(fsdp_config, seed, activation_checkpointing):
    """What a Tango-style engine does (with the three names it imports from FairScale): build the
    model, wrap the modules whose names fully match a pattern (checkpoint_wrapper with
    offload_to_cpu=True first when activation checkpointing is on, then FSDP) and re-attach them
    with add_module, wrap the root, build the optimizer over the root's (flat, sharded)
    parameters, and a ShardedGradScaler for AMP."""
    import re

    from fairscale_c.nn.checkpoint import checkpoint_wrapper
    from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP
    from fairscale_c.optim.grad_scaler import ShardedGradScaler

    torch.manual_seed(seed)
    model = TangoFixture()
    for name, module in list(model.named_modules()):
        if re.fullmatch(r"blocks\.[0-9]+", name):
            if activation_checkpointing:
                module = checkpoint_wrapper(module, offload_to_cpu=True)
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent).add_module(child, FSDP(module, **fsdp_config))
    model = FSDP(model, **fsdp_config)
    scaler = ShardedGradScaler() if fsdp_config["mixed_precision"] else None
    return model, torch.optim.AdamW(model.parameters(), lr=0.005), scaler


def _tango_batches(step, rank, world):
    """Two micro-batches of 2 items per rank per step, from 32 items (seed 317), rank-strided as
    a DistributedSampler without shuffling gives them."""
    g = torch.Generator().manual_seed(317)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
    idx = [(step * 4 * world + 4 * rank + k) % 32 for k in range(4)]
    return [(x[idx[:2]], y[idx[:2]]), (x[idx[2:]], y[idx[2:]])]


def _tango_step(model, opt, scaler, step, rank, world, amp):
    """forward_train per micro-batch (autocast, loss / n), backward (scaled under AMP), then
    unscale, clip, step and update the scale."""
    opt.zero_grad(set_to_none=True)
    micro = _tango_batches(step, rank, world)
    for x, y in micro:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = model(x=x, y=y)["loss"] / len(micro)
        (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(opt)
    model.clip_grad_norm_(1.0)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def tango_engine(rank, world):
    """Train 4 steps straight, and 2 + save per-worker checkpoints + resume into a freshly built
    engine + 2: identical weights; the worker files consolidate into the plain model."""
    from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP

    d = CKPT["dir"]
    for amp, ckpting in ((False, False), (True, True)):  # AMP with activation checkpointing too
        fsdp_config = dict(
            reshard_after_forward=True, move_params_to_cpu=False, move_grads_to_cpu=None, mixed_precision=amp
        )
        straight, opt, scaler = _tango_build(fsdp_config, 317, ckpting)
        for step in range(4):
            _tango_step(straight, opt, scaler, step, rank, world, amp)

        model, opt, scaler = _tango_build(fsdp_config, 317, ckpting)
        for step in range(2):
            _tango_step(model, opt, scaler, step, rank, world, amp)
        ckpt = os.path.join(d, f"amp{int(amp)}")
        os.makedirs(ckpt, exist_ok=True)
        state = {"weights": model.local_state_dict(), "metadata": model.local_metadata_dict()}
        _atomic_save(state, os.path.join(ckpt, f"worker{rank}_model.pt"))
        _atomic_save(opt.state_dict(), os.path.join(ckpt, f"worker{rank}_optimizer.pt"))
        if scaler:
            _atomic_save(scaler.state_dict(), os.path.join(ckpt, f"worker{rank}_grad_scaler.pt"))
        dist.barrier()

        resumed, opt, scaler = _tango_build(fsdp_config, 1, ckpting)  # other init: all from the files
        resumed.load_local_state_dict(torch.load(os.path.join(ckpt, f"worker{rank}_model.pt"))["weights"])
        opt.load_state_dict(torch.load(os.path.join(ckpt, f"worker{rank}_optimizer.pt")))
        if scaler:
            scaler.load_state_dict(torch.load(os.path.join(ckpt, f"worker{rank}_grad_scaler.pt")))
        for step in range(2, 4):
            _tango_step(resumed, opt, scaler, step, rank, world, amp)
        for (k, a), (_, b) in zip(straight.local_state_dict().items(), resumed.local_state_dict().items()):
            assert torch.equal(a, b), f"amp={amp}: {k} differs after resuming"

        # save_complete_weights_from_checkpoint: every worker's file, in worker order.
        files = sorted(
            (f for f in os.listdir(ckpt) if f.endswith("_model.pt")), key=lambda f: int(f[len("worker") : -9])
        )
        shards = [torch.load(os.path.join(ckpt, f)) for f in files]
        full = FSDP.consolidate_shard_weights([s["weights"] for s in shards], [s["metadata"] for s in shards])
        plain = TangoFixture()
        missing, unexpected = plain.load_state_dict(full, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        x, y = _tango_batches(0, 0, 1)[0]
        with torch.no_grad():
            want = plain(x=x, y=y)["loss"]
            state_model, _, _ = _tango_build(fsdp_config, 2, ckpting)
            state_model.load_local_state_dict(shards[rank]["weights"])
            got = state_model(x=x, y=y)["loss"]
        tol = BF16_TOL if amp else FP32_TOL  # mixed precision computes in fp16 from the same weights
        torch.testing.assert_close(got, want, **tol)
        dist.barrier()


SCENARIOS.update(state_save=state_save, state_load=state_load, memory_per_rank=memory_per_rank)
SCENARIOS.update(state_errors=state_errors)
SCENARIOS.update(tango_engine=tango_engine)


def shards_shared(rank, world):
    """On CPU the flat parameters' shards live in shared tensors (one allocation per flat
    parameter, a slice per rank), and the forward's all-gathers of full-precision parameters copy
    the peers' shards straight from their memory; the result is what a plain model computes."""
    import fairscale_c.distributed as fdist
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 8))
    model = FSDP(copy.deepcopy(ref))
    params = list(model.parameters())
    assert params and all(fdist.is_shared(p) == (world > 1) for p in params), [fdist.is_shared(p) for p in params]
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(rank))
    shm = getattr(model.comm, "_shm", None)  # world 1: a LocalGroup, no engine
    before = shm.mapped_ops if shm is not None else 0
    got = model(x)
    torch.testing.assert_close(got, ref(x))
    if world > 1:
        assert shm.mapped_ops > before, "the forward's all-gather did not read the shards where they lie"


SCENARIOS.update(shards_shared=shards_shared)


def dataloader_fork_workers(rank, world):
    """Training with a DataLoader whose workers are fork()ed from a rank that runs the engine's
    progress threads (a new set of workers each epoch): the workers never touch the groups, so
    training carries on and matches the same loop without workers."""
    from torch.utils.data import DataLoader, TensorDataset

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    data = TensorDataset(torch.randn(48, 8, generator=torch.Generator().manual_seed(rank)), torch.randn(48, 4))
    results = []
    for workers in (2, 0):
        torch.manual_seed(0)
        model = FSDP(MLP())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = DataLoader(
            data, batch_size=8, num_workers=workers, multiprocessing_context="fork" if workers else None
        )
        for _ in range(2):
            for x, y in loader:
                mse(model, x, y).backward()
                opt.step()
                opt.zero_grad()
        results.append(model.state_dict())
    for k, v in results[1].items():
        assert torch.equal(results[0][k], v), k


SCENARIOS.update(dataloader_fork_workers=dataloader_fork_workers)


@dataclasses.dataclass(frozen=True)
class _Output:
    out: torch.Tensor
    note: str = "dataclass"


class _Box:
    """An object FSDP does not look into."""

    def __init__(self, t):
        self.t = t


class _Unboxed(nn.Module):
    def __init__(self, inner, box):
        super().__init__()
        self.inner, self.box = inner, box

    def forward(self, x):
        y = self.inner(x)
        return _Box(y) if self.box else _Output(y)


class _OutputsOfAnyType(nn.Module):
    """An MLP whose middle layer and whole output come back in a dataclass or in a plain object."""

    def __init__(self, box):
        super().__init__()
        self.fc1, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.fc2 = _Unboxed(nn.Linear(16, 16), box)
        self.box = box

    def forward(self, x):
        h = self.fc2(F.relu(self.fc1(x)))
        h = h.t if self.box else h.out
        y = self.fc3(F.relu(h))
        return _Box(y) if self.box else _Output(y)


def outputs_of_any_type(rank, world):
    """A model returning a dataclass (frozen) trains as plain torch does, through nested instances
    that reshard after forward; one returning objects FSDP cannot look into trains too, with a
    warning naming the type."""
    import warnings

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    def wrap(flatten, model):
        model.fc2 = FSDP(model.fc2, reshard_after_forward=True)
        return FSDP(model, flatten_parameters=flatten)

    def loss(box, model, x, y):
        out = model(x)
        return F.mse_loss(out.t if box else out.out, y)

    for box in (False, True):
        for flatten in (True, False):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                make = functools.partial(_OutputsOfAnyType, box)
                wrapped = functools.partial(wrap, flatten)
                train_and_compare(rank, world, make, wrapped, loss_fn=functools.partial(loss, box))
            named = [str(w.message) for w in caught if "_Box" in str(w.message)]
            assert bool(named) == box, [str(w.message) for w in caught]


SCENARIOS.update(outputs_of_any_type=outputs_of_any_type)


def no_sync_grads_on_params(rank, world):
    """After a backward in no_sync() the parameters' .grad hold the full local gradient,
    unreduced (FairScale's flat parameters do): zero_grad() between micro-batches discards it,
    in-place or to None; without it the micro-batches add up, also onto a shard left from an
    earlier synchronised backward."""
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(world * LOCAL_BATCH, 8, generator=gen) for _ in range(3)]
    ys = [torch.randn(world * LOCAL_BATCH, 4, generator=gen) for _ in range(3)]
    # which micro-batches run in no_sync, and what happens between them: "zero" (set_to_none),
    # "zero_inplace", or "" (accumulate)
    plans = {
        "dropped": [(0, True, "zero"), (1, False, "")],
        "dropped_in_place": [(0, True, "zero_inplace"), (1, False, "")],
        "accumulated": [(0, True, ""), (1, True, ""), (2, False, "")],
        "onto_a_shard": [(0, False, ""), (1, True, ""), (2, False, "")],
    }
    for flatten in (True, False):
        for plan_name, plan in plans.items():
            torch.manual_seed(0)
            ref = MLP()
            fsdp = FSDP(copy.deepcopy(ref), flatten_parameters=flatten)
            local = copy.deepcopy(ref)  # this rank's own gradients since the last reduction
            for i, in_no_sync, between in plan:
                with fsdp.no_sync() if in_no_sync else _nullcontext():
                    mse(fsdp, _local(xs[i], rank), _local(ys[i], rank)).backward()
                mse(local, _local(xs[i], rank), _local(ys[i], rank)).backward()
                if in_no_sync:
                    shown = [p.grad for p in fsdp.parameters()]
                    expected = [p.grad for p in local.parameters()]
                    if flatten:
                        expected = [torch.cat([g.reshape(-1) for g in expected])]
                    assert [g.shape for g in shown] == [g.shape for g in expected], plan_name
                    for g, e in zip(shown, expected):
                        torch.testing.assert_close(g, e, **FP32_TOL, msg=f"{plan_name}, flatten={flatten}")
                else:
                    local.zero_grad()
                mse(ref, xs[i], ys[i]).backward()
                if between:
                    for m in (fsdp, ref, local):
                        m.zero_grad(set_to_none=between == "zero")
            torch.optim.SGD(fsdp.parameters(), lr=0.1).step()
            torch.optim.SGD(ref.parameters(), lr=0.1).step()
            sd = fsdp.state_dict()
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=f"{plan_name}, flatten={flatten}: {k}")


SCENARIOS.update(no_sync_grads_on_params=no_sync_grads_on_params)


def clip_norm_types(rank, world):
    """clip_grad_norm_ for every norm type torch's takes but 0 (refused): the total norm and the
    clipped gradients equal torch's on the whole batch; -inf (the smallest |g|) does not count
    the padding of a flat parameter whose size does not divide by the world size."""
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(world * LOCAL_BATCH, 3, generator=gen), torch.randn(world * LOCAL_BATCH, 1, generator=gen)
    for norm_type in (2.0, 1.0, 3.0, float("inf"), float("-inf"), -1.0):
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))  # 11 parameters: padded at world 2
        fsdp = FSDP(copy.deepcopy(ref))
        mse(fsdp, _local(x, rank), _local(y, rank)).backward()
        mse(ref, x, y).backward()
        total = fsdp.clip_grad_norm_(1e-3, norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type)
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-7, msg=lambda m, p=norm_type: f"norm {p}: {m}")
        torch.optim.SGD(fsdp.parameters(), lr=1.0).step()
        torch.optim.SGD(ref.parameters(), lr=1.0).step()
        sd = fsdp.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=lambda m, p=norm_type, k=k: f"norm {p}, {k}: {m}")
    with pytest.raises(ValueError, match="argument 'norm_type' must be a number other than 0"):
        fsdp.clip_grad_norm_(1.0, 0)


SCENARIOS.update(clip_norm_types=clip_norm_types)


def _held():
    """What this process holds: open file descriptors, threads, mappings of the engine's
    shared-memory segments, resident pages, and live tensors (after a full collection). Freed heap
    memory is handed back to the system first (glibc's malloc_trim, where there is one), so that
    resident pages count what is live, not what the allocator happens to keep."""
    import ctypes
    import gc

    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/fsc-" in line)
    tensors = sum(1 for o in gc.get_objects() if torch.is_tensor(o))
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "shm maps": maps,
        "tensors": tensors,
        "rss": rss_pages * os.sysconf("SC_PAGE_SIZE"),
    }


def steady_state(rank, world):
    """Many training steps hold nothing new: after warm-up, 40 more steps (bf16 mixed precision,
    gradients in buckets and alone, clip_grad_norm_, a full and a local state dict every 10 steps)
    leave the same file descriptors, threads, shared-memory mappings and live tensors, and resident
    memory grows by less than one step's worth of leaked gradients would add (the model's
    gradients are 1.8 MiB in fp32)."""
    from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = nested_manual_wrap(
        TinyLM(vocab=512, d=128, n_layers=2, seq=16),
        mixed_precision=True,
        compute_dtype=torch.bfloat16,
        bucket_cap_mb=0.3,
    )
    assert isinstance(model, FSDP)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)

    def step(i):
        idx = torch.randint(0, 512, (2, 16), generator=gen)
        xent(model, idx, torch.roll(idx, -1, dims=1)).backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 10 == 9:
            model.state_dict()
            model.local_state_dict()

    for i in range(10):
        step(i)
    before = _held()
    for i in range(40):
        step(i)
    after = _held()
    for key in ("fds", "threads", "shm maps", "tensors"):
        assert after[key] <= before[key], f"{key}: {before[key]} -> {after[key]} over 40 steps"
    if "asan" not in os.environ.get("LD_PRELOAD", ""):  # ASan's quarantine keeps freed memory resident
        grown = after["rss"] - before["rss"]
        assert grown < 4 * 2**20, f"resident memory grew {grown / 2**20:.1f} MiB over 40 steps"


SCENARIOS.update(steady_state=steady_state)


def reduce_scatters_in_flight(rank, world):
    """Full gradients do not pile up during backward: with every gradient reduce-scattered alone
    (bucket_cap_mb=0) through 6 wrapped blocks, at most two reduce-scatters (and so two full
    gradients) are alive at any point of backward; the rest have already become shard gradients."""
    from fairscale_c.nn.data_parallel import _bucket

    torch.manual_seed(0)
    model = nested_manual_wrap(TinyLM(n_layers=6), bucket_cap_mb=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    original = _bucket.ReduceScatterBucket.add

    def add(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(sum(len(issued.members) for issued in self.in_flight))

    _bucket.ReduceScatterBucket.add = add
    try:
        gen = torch.Generator().manual_seed(1)
        for step in range(2):
            x, y = lm_batch(step, world, gen)
            xent(model, _local(x, rank), _local(y, rank)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        _bucket.ReduceScatterBucket.add = original
    assert len(seen) == 2 * 7, seen  # 6 blocks + the root, per step
    assert max(seen) <= _bucket._MAX_IN_FLIGHT, seen
    assert all(p.grad is None for p in model.parameters())


SCENARIOS.update(reduce_scatters_in_flight=reduce_scatters_in_flight)


class LayerDrop(nn.Module):
    """Ranks that skip different layers issue different collectives (FairScale issue 796)."""

    def __init__(self, skip):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.skip = skip

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if not self.skip:
            h = F.relu(self.fc2(h))
        return self.fc3(h)


def divergent_ranks(rank, world):
    """A rank that skips a wrapped layer gets a DistributedError naming the mismatch, as do the
    others — instead of the hang FairScale shows."""
    from fairscale_c import DistributedError
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    model = LayerDrop(skip=rank == 1)
    model.fc2, model.fc3 = FSDP(model.fc2), FSDP(nn.Linear(16, 4))
    model = FSDP(model)
    try:
        model(torch.randn(2, 8)).sum().backward()
    except DistributedError as e:
        assert "mismatch" in str(e) and "all_gather" in str(e), e
    else:
        raise AssertionError("diverging ranks were not reported")


SCENARIOS["divergent_ranks"] = divergent_ranks


def dead_peer(rank, world):
    """A rank that dies mid-training: the survivor's next collective raises DistributedError naming
    it, within seconds (the engine watches peers' pids), never a hang. Returns (message, seconds)."""
    import time

    from fairscale_c import DistributedError
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    os.environ["FAIRSCALE_C_TIMEOUT"] = "60"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # from the RANK / WORLD_SIZE / MASTER_* environment
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(FSDP(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 4)))
    x = torch.randn(4, 8)
    model(x).sum().backward()  # one healthy step on both ranks
    if rank == 1:
        os._exit(3)  # dies without any cleanup
    t0 = time.monotonic()
    try:
        for _ in range(3):
            model(x).sum().backward()
    except DistributedError as e:
        return str(e), time.monotonic() - t0
    raise AssertionError("the dead peer was not reported")


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (a user's backward that fails midway)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _FailingBackward.armed:
            raise RuntimeError("backward failed on purpose")
        return g


class _FailsInBackward(nn.Module):
    def forward(self, x):
        return _FailingBackward.apply(x)


def backward_that_raises(rank, world):
    """A backward that raises midway (after the layers above the failure have reduce-scattered,
    before those below ran) leaves no gradient: the gradient shards are as it found them, the
    no_sync() accumulation is dropped with it, and nothing of it is left for the next backward.
    The state dict works at once, and training goes on as plain torch's does after the usual
    recovery (zero_grad and the next batch)."""
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn.data_parallel import get_fsdp_instances

    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(world * LOCAL_BATCH, 8, generator=gen) for _ in range(4)]
    ys = [torch.randn(world * LOCAL_BATCH, 4, generator=gen) for _ in range(4)]

    def build():
        torch.manual_seed(0)
        layers = [nn.Linear(8, 16), nn.ReLU(), _FailsInBackward(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]
        return nn.Sequential(*layers)

    # (micro-batch, in no_sync, its backward fails); after a failure both sides zero_grad, the usual
    # recovery (torch keeps on .grad the part the failed backward computed; zero_grad drops it)
    plans = {
        "synchronised": [(0, False, True), (1, False, False), (2, False, False)],
        "in_no_sync": [(0, True, False), (1, True, True), (2, True, False), (3, False, False)],
    }
    for flatten in (True, False):
        for plan_name, plan in plans.items():
            ref = build()
            fsdp = FSDP(
                nn.Sequential(
                    *[
                        FSDP(copy.deepcopy(m), flatten_parameters=flatten) if i in (0, 3, 5) else m
                        for i, m in enumerate(ref)
                    ]
                ),
                flatten_parameters=flatten,
            )
            fsdp_opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            where = f"{plan_name}, flatten={flatten}"
            for i, in_no_sync, fails in plan:
                _FailingBackward.armed = fails
                try:
                    with fsdp.no_sync() if in_no_sync else _nullcontext():
                        loss = mse(fsdp, _local(xs[i], rank), _local(ys[i], rank))
                        with pytest.raises(RuntimeError, match="on purpose") if fails else _nullcontext():
                            loss.backward()
                    with pytest.raises(RuntimeError, match="on purpose") if fails else _nullcontext():
                        mse(ref, xs[i], ys[i]).backward()
                finally:
                    _FailingBackward.armed = False
                if fails:
                    fsdp.zero_grad()  # the first call after the failure: it sees every parameter
                    ref_opt.zero_grad()
                    assert len(list(fsdp.parameters())) == len(list(fsdp_opt.param_groups[0]["params"])), where
                    assert all(p.grad is None for p in fsdp_opt.param_groups[0]["params"]), where
                    before = [p.detach().clone() for p in ref.parameters()]
                    sd = fsdp.state_dict()  # usable at once, and unchanged
                    for k, b in zip(ref.state_dict(), before):
                        torch.testing.assert_close(sd[k], b, **FP32_TOL, msg=f"{where}: {k}")
                    assert all(m.training_state.name == "IDLE" for m in get_fsdp_instances(fsdp)), where
                    held = [h for m in get_fsdp_instances(fsdp) for h in m._handles if h.has_full]
                    assert not held, f"{where}: {len(held)} full parameters still held"
                elif not in_no_sync:
                    fsdp_opt.step()
                    ref_opt.step()
                    fsdp_opt.zero_grad()
                    ref_opt.zero_grad()
            sd = fsdp.state_dict()
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=f"{where}: {k}")

    # Without zero_grad the shards keep what the last good backward left, nothing of the failed one.
    ref = build()
    fsdp = FSDP(nn.Sequential(*[FSDP(copy.deepcopy(m)) if i in (0, 3, 5) else m for i, m in enumerate(ref)]))
    mse(fsdp, _local(xs[0], rank), _local(ys[0], rank)).backward()
    good = [p.grad.clone() for p in fsdp.parameters()]
    _FailingBackward.armed = True
    try:
        with pytest.raises(RuntimeError, match="on purpose"):
            mse(fsdp, _local(xs[1], rank), _local(ys[1], rank)).backward()
    finally:
        _FailingBackward.armed = False
    fsdp.clip_grad_norm_(1e9)  # a user call after the failure finishes it off
    for p, g in zip(fsdp.parameters(), good):
        torch.testing.assert_close(p.grad, g, **FP32_TOL)


SCENARIOS.update(backward_that_raises=backward_that_raises)


def _train_alike(fsdp, ref, xs, rank, world, loss_of, after_step=None):
    """SGD steps (lr 0.1) of `fsdp` on this rank's part of each batch and of `ref` on the mean of
    every rank's loss, the same data in one process; `after_step()` runs after each."""
    opt, ref_opt = torch.optim.SGD(fsdp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in xs:
        loss_of(fsdp, _local(x, rank)).backward()
        (sum(loss_of(ref, _local(x, r)) for r in range(world)) / world).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if after_step is not None:
            after_step()
    return opt


def gradient_penalty(rank, world):
    """A gradient penalty (WGAN-GP: the gradient with respect to the input, taken with
    create_graph=True, in the loss) trains as in plain torch, flat and unflattened, nested, with
    and without resharding: the full parameters stay for the graph of gradients until the next
    backward has used it. A create_graph backward into the parameters' gradients is refused."""
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(world * LOCAL_BATCH, 8, generator=gen) for _ in range(3)]

    def loss_of(model, x):
        x = x.clone().requires_grad_(True)
        out = model(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.pow(2).mean() + ((g.norm(dim=1) - 1) ** 2).mean()

    for flatten in (True, False):
        for reshard in (True, False):
            torch.manual_seed(0)
            ref = MLP()
            fsdp = copy.deepcopy(ref)
            fsdp.fc2 = FSDP(fsdp.fc2, flatten_parameters=flatten, reshard_after_forward=reshard)
            fsdp = FSDP(fsdp, flatten_parameters=flatten, reshard_after_forward=reshard)
            opt = _train_alike(fsdp, ref, xs, rank, world, loss_of)
            sd = fsdp.state_dict()
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=f"flatten={flatten}, reshard={reshard}: {k}")
    with pytest.raises(RuntimeError, match="create_graph=True that reaches the parameters' gradients"):
        fsdp(_local(xs[0], rank)).sum().backward(create_graph=True)
    opt.zero_grad()
    loss_of(fsdp, _local(xs[0], rank)).backward()  # and training goes on


SCENARIOS.update(gradient_penalty=gradient_penalty)


class _GradientInForward(nn.Module):
    """Physics-informed style: the forward takes the gradient of an inner instance's output with
    respect to the input, so that instance's backward begins inside the root's forward."""

    def __init__(self, checkpointed, derivative_only=False):
        super().__init__()
        from fairscale_c.nn import checkpoint_wrapper

        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        if checkpointed:
            self.body[0] = checkpoint_wrapper(self.body[0])
        self.head = nn.Linear(8, 1)
        self.derivative_only = derivative_only

    def forward(self, x):
        u = self.body(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        # a loss of the derivative only reaches the inner instance through this graph alone
        return self.head(du) if self.derivative_only else self.head(du) + u


def gradient_inside_forward(rank, world):
    """That model with a penalty over parameters() in the loss trains as in plain torch, flat and
    unflattened, resharding or not, with activation checkpointing inside the inner instance: the
    inner instance's shards are registered again when the gradient inside the forward is done,
    and nothing keeps the full parameters after the step."""
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn.data_parallel import get_fsdp_instances

    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(world * LOCAL_BATCH, 8, generator=gen) for _ in range(3)]

    def loss_of(model, x):
        out = model(x.clone().requires_grad_(True))
        return out.pow(2).mean() + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())

    for flatten, reshard, checkpointed, derivative_only in itertools.product([True, False], repeat=4):
        where = f"flatten={flatten}, reshard={reshard}, checkpointed={checkpointed}, derivative={derivative_only}"
        torch.manual_seed(0)
        ref = _GradientInForward(checkpointed, derivative_only)
        fsdp = copy.deepcopy(ref)
        fsdp.body = FSDP(fsdp.body, flatten_parameters=flatten, reshard_after_forward=reshard)
        fsdp = FSDP(fsdp, flatten_parameters=flatten, reshard_after_forward=reshard)

        def nothing_held(fsdp=fsdp, reshard=reshard, where=where):
            held = [h for m in get_fsdp_instances(fsdp) for h in m._handles if h.has_full]
            assert not reshard or not held, f"{where}: {len(held)} full parameters held after the step"

        # the penalty counts every rank's shard once: the reference's is divided as the loss is
        _train_alike(fsdp, ref, xs, rank, world, loss_of, nothing_held)
        sd = fsdp.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=f"{where}: {k}")


SCENARIOS.update(gradient_inside_forward=gradient_inside_forward)


def later_layout_mismatch(rank, world):
    """Ranks whose models differ only in a later flat parameter (a frozen last layer, or any
    parameter but the first unflattened): the construction is refused on every rank, the module's
    parameters untouched, and the corrected model builds and trains as plain torch."""
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    for flatten in (True, False):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2 + rank))  # the last layer differs per rank
        if flatten:
            m[1].requires_grad_(False)  # a flat parameter of its own
        before = {n: (p, p.detach().clone()) for n, p in m.named_parameters()}
        with pytest.raises(ValueError, match="every rank must ask for the same size"):
            FSDP(m, flatten_parameters=flatten)
        after = dict(m.named_parameters())
        assert list(after) == list(before), (flatten, list(after))
        for n, (p, data) in before.items():
            assert after[n] is p and torch.equal(p, data), (flatten, n)
        torch.manual_seed(1)
        m[1] = nn.Linear(8, 2)
        ref = copy.deepcopy(m)
        fsdp = FSDP(m, flatten_parameters=flatten)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))  # one batch on every rank
        fsdp(x).sum().backward()
        ref(x).sum().backward()
        for o in (torch.optim.SGD(fsdp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)):
            o.step()
        got = fsdp.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, **FP32_TOL, msg=f"flatten={flatten}: {k}")


SCENARIOS.update(later_layout_mismatch=later_layout_mismatch)


class _KeepsItsResult(nn.Module):
    """Leaves its result in an attribute that the parent reads; returns None, or a copy nobody uses."""

    def __init__(self, returns):
        super().__init__()
        self.lin, self.returns, self.cache = nn.Linear(8, 10), returns, None

    def forward(self, x):
        self.cache = torch.tanh(self.lin(x))
        return None if self.returns == "None" else self.cache * 1.0


class _ReadsTheAttribute(nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.inner, self.head = _KeepsItsResult(returns), nn.Linear(10, 3)

    def forward(self, x):
        self.inner(x)
        inner = getattr(self.inner, "module", self.inner)
        return self.head(inner.cache)


def result_in_an_attribute(rank, world):
    """A nested instance whose result the parent reads from an attribute: the backward reaches its
    parameters without its pre-backward hook. Returning None it trains as plain torch (no prefetch
    writes into its released buffers meanwhile); returning a tensor the backward never reaches, a
    prefetch may have gathered into them while its backward ran, and that is a clear RuntimeError
    that the next step recovers from; the buffer the prefetch writes is not freed under it."""
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(world * LOCAL_BATCH, 8, generator=gen) for _ in range(3)]
    for flatten in (True, False):
        where = f"flatten={flatten}"
        torch.manual_seed(0)
        ref = _ReadsTheAttribute("None")
        fsdp = copy.deepcopy(ref)
        fsdp.inner = FSDP(fsdp.inner, flatten_parameters=flatten)
        fsdp = FSDP(fsdp, flatten_parameters=flatten)
        _train_alike(fsdp, ref, xs, rank, world, lambda model, x: model(x).pow(2).mean())
        sd = fsdp.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, **FP32_TOL, msg=f"{where}: {k}")
        torch.manual_seed(0)
        model = _ReadsTheAttribute("an unused copy")
        model.inner = FSDP(model.inner, flatten_parameters=flatten)
        model = FSDP(model, flatten_parameters=flatten)
        model(_local(xs[0], rank)).sum().backward()  # the first: no order recorded, no prefetch
        with pytest.raises(RuntimeError, match="reached this instance's parameters but not the outputs"):
            model(_local(xs[1], rank)).sum().backward()
        model.zero_grad()
        model.inner.reshard_after_forward = False  # what the message says to do
        model(_local(xs[2], rank)).sum().backward()


SCENARIOS.update(result_in_an_attribute=result_in_an_attribute)


def forward_between_backward_and_step(rank, world):
    """A forward between a backward and the optimizer step (an evaluation under no_grad, or a
    forward for logging whose graph is dropped): the full parameters it keeps (the root's, or an
    instance's with reshard_after_forward=False) are gathered again after the step, so the next
    forward computes with the stepped weights, as plain torch does."""
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(world * LOCAL_BATCH, 8, generator=gen) for _ in range(3)]
    for mixed in (False, True):
        for reshard in (True, False):
            where = f"mixed_precision={mixed}, reshard={reshard}"
            torch.manual_seed(0)
            ref = MLP()
            fsdp = copy.deepcopy(ref)
            fsdp.fc2 = FSDP(fsdp.fc2, reshard_after_forward=reshard, mixed_precision=mixed)
            fsdp = FSDP(fsdp, reshard_after_forward=reshard, mixed_precision=mixed)
            opt, ref_opt = torch.optim.SGD(fsdp.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
            for i, x in enumerate(xs):
                fsdp(_local(x, rank)).pow(2).mean().backward()
                (sum(ref(_local(x, r)).pow(2).mean() for r in range(world)) / world).backward()
                if i % 2:
                    with torch.no_grad():
                        fsdp(_local(x, rank))
                else:
                    fsdp(_local(x, rank)).sum()  # a graph that is dropped
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad()
                with torch.no_grad():
                    got, want = fsdp(_local(x, rank)), ref(_local(x, rank))
                tol = dict(atol=2e-2, rtol=2e-2) if mixed else FP32_TOL
                torch.testing.assert_close(got.float(), want, **tol, msg=f"{where}, step {i}")
            # an optimizer of other parameters that one rank steps between evaluation forwards
            # does not count, nor does one of another FSDP model on this rank's own group: the
            # ranks still gather alike
            probe = nn.Linear(2, 2)
            own = [dist.new_group([r]) for r in range(world)][rank]
            own_model = FSDP(nn.Linear(2, 2), process_group=own)
            if rank == 0:
                for m in (probe, own_model):
                    m(torch.ones(1, 2)).sum().backward()
                    torch.optim.SGD(m.parameters(), lr=0.1).step()
            with torch.no_grad():
                torch.testing.assert_close(fsdp(_local(xs[0], rank)).float(), ref(_local(xs[0], rank)), **tol)


SCENARIOS.update(forward_between_backward_and_step=forward_between_backward_and_step)
