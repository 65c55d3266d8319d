"""OSS benchmark: fairscale_c's OSS + ShardedDataParallel against FairScale 0.4.13's, PyTorch's
ZeroRedundancyOptimizer + DDP and plain DDP, on a GPT-style model with AdamW.

CPU, `--world` ranks (default 2) as spawned processes, one fresh set of processes per framework
(so none inflates another's memory high-water mark); FairScale, ZeRO and DDP on gloo, fairscale_c
on its own collectives engine. The model, the batches, the training loop, the memory measurement
and the "local" compute floor (each rank trains an unsharded copy, no communication) are
benchmarks/fsdp.py's, reused here
(the step differs only in how the ShardedDataParallel rows clear gradients, see `train`).

    PYTHONPATH=. python benchmarks/oss.py            # default model (27M parameters), fp32
    PYTHONPATH=. python benchmarks/oss.py --quick    # tiny model, a few steps (< 1 minute)
    PYTHONPATH=. python benchmarks/oss.py --device cuda [--preset 350m] [--bf16] [--deterministic]   # on GPUs, NCCL

Reported per framework: median step time (zero_grad + forward + loss + backward + optimizer
step + loss.item(); per step the slowest rank counts), own time above the floor, optimizer-state
bytes per rank (the tensors in the rank-local optimizer's state), peak RSS growth per rank, and
the per-step losses compared with FairScale's. Targets (printed as verdict lines): step <= 1.05x
the floor, own time <= 0.25x FairScale's own time, optimizer state per rank <= total/N + the
largest parameter's state, losses within fp32 rounding of FairScale's.

FairScale is optional: without `fairscale` importable its row is skipped, and said so. So is
fairscale_c's row while `fairscale_c.optim.OSS` / `fairscale_c.nn.ShardedDataParallel` do not exist.

Results go to stdout (a table) and benchmarks/results/oss.json.

`--device cuda` (see run_cuda): the same rows on GPUs, rank r on cuda:r % device_count (two
ranks may share one GPU with NCCL >= 2.30; the script sets NCCL_MULTI_RANK_GPU_ENABLE=1 then).
FairScale, ZeRO and DDP on torch's nccl backend, fairscale_c on its own NCCL communicators (its
groups send CUDA tensors to NCCL). A GPT-2-sized model by default (`--preset 125m`, or `350m`),
one fresh set of processes per framework (no paired run), `--bf16` for bf16 autocast of forward
and loss (parameters, gradients and optimizer state stay fp32). Step times are host times with
torch.cuda.synchronize() at both ends of each step, the phases CUDA-event intervals on the
compute stream; memory is torch.cuda.max_memory_allocated over the timed steps (peak statistics
reset after the warm-up). Results: benchmarks/results/oss_cuda.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

import fsdp as base  # benchmarks/fsdp.py: model, batches, memory measurement, spawning, summaries
from _harness import check_cuda_ranks, cuda_info, rank_cuda_device

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "oss.json")
RESULTS_CUDA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "oss_cuda.json")
REFERENCE = "fairscale"  # own time and losses are compared with FairScale's
TARGET_STEP_OVER_FLOOR = 1.05
TARGET_OWN_VS_FAIRSCALE = 0.25
# "Within fp32 rounding": FairScale and fairscale_c sum the two ranks' gradients in different
# orders, so per-step losses may differ by a few ulps of the loss, growing slowly over steps.
LOSS_RTOL = 1e-5
FRAMEWORKS = ("fairscale_c", "fairscale", "torch_zero", "ddp", "local")


def default_config() -> base.Config:
    """27.3M parameters (vocab 16384 x 512 tied embedding, 6 blocks of d_model 512)."""
    return base.Config(layers=6, d_model=512, heads=8, seq=64, vocab=16384, batch=4, steps=20, warmup=3)


# --device cuda models: GPT-2 small and medium shapes (vocab 50304, tied head), 8 sequences of 512
# tokens per rank per step
CUDA_PRESETS = {
    "125m": {"layers": 12, "d_model": 768, "heads": 12},  # 124.1M parameters
    "350m": {"layers": 24, "d_model": 1024, "heads": 16},  # 354.3M parameters
}


def cuda_config(preset: str = "125m") -> base.Config:
    if preset not in CUDA_PRESETS:
        raise ValueError(f"preset must be one of {sorted(CUDA_PRESETS)}, got {preset!r}")
    return base.Config(**CUDA_PRESETS[preset], seq=512, vocab=50304, batch=8, steps=10, warmup=3)


# ---------------------------------------------------------------- wrapping: (model, optimizer)


def _adamw(cfg: base.Config) -> Dict[str, Any]:
    return {"lr": cfg.lr}


def build_fairscale_c(model: nn.Module, cfg: base.Config) -> Tuple[nn.Module, Any]:
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    opt = OSS(model.parameters(), optim=torch.optim.AdamW, **_adamw(cfg))
    return ShardedDataParallel(model, opt), opt


def build_fairscale(model: nn.Module, cfg: base.Config) -> Tuple[nn.Module, Any]:
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    opt = OSS(model.parameters(), optim=torch.optim.AdamW, **_adamw(cfg))
    return ShardedDataParallel(model, opt), opt


def build_torch_zero(model: nn.Module, cfg: base.Config) -> Tuple[nn.Module, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **_adamw(cfg))


def build_ddp(model: nn.Module, cfg: base.Config) -> Tuple[nn.Module, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    return ddp, torch.optim.AdamW(ddp.parameters(), **_adamw(cfg))


def build_local(model: nn.Module, cfg: base.Config) -> Tuple[nn.Module, Any]:
    """The compute floor: benchmarks/fsdp.py's local row (no wrapper, no communication; its AdamW
    steps every parameter, where the sharded optimizers step 1/world of them)."""
    model = base.wrap_local(model, cfg)
    return model, torch.optim.AdamW(model.parameters(), **_adamw(cfg))


BUILDERS: Dict[str, Callable[[nn.Module, base.Config], Tuple[nn.Module, Any]]] = {
    "fairscale_c": build_fairscale_c,
    "fairscale": build_fairscale,
    "torch_zero": build_torch_zero,
    "ddp": build_ddp,
    "local": build_local,
}
MODULES = {
    "fairscale_c": ("fairscale_c.optim", "fairscale_c.nn"),
    "fairscale": ("fairscale.optim", "fairscale.nn.data_parallel"),
    "torch_zero": ("torch.distributed.optim", "torch.nn.parallel"),
    "ddp": ("torch.nn.parallel",),
    "local": ("torch.nn",),
}


def unavailable(framework: str) -> Optional[str]:
    """Why `framework` cannot run here, or None."""
    if framework == "fairscale" and importlib.util.find_spec("fairscale") is None:
        return "fairscale is not installed (pip install fairscale==0.4.13)"
    if framework == "fairscale_c":
        import fairscale_c.nn
        import fairscale_c.optim

        missing = [
            n
            for n, mod in (
                ("fairscale_c.optim.OSS", fairscale_c.optim),
                ("fairscale_c.nn.ShardedDataParallel", fairscale_c.nn),
            )
            if not hasattr(mod, n.rsplit(".", 1)[1])
        ]
        if missing:
            return f"{' and '.join(missing)} not in this build"
    return None


# ---------------------------------------------------------------- one rank


def local_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: OSS's and ZeRO's `optim`, else the optimizer."""
    inner = getattr(opt, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in an optimizer's state (each storage counted once)."""
    seen, total = set(), 0
    for per_param in opt.state.values():
        if not isinstance(per_param, dict):
            continue
        for t in per_param.values():
            if torch.is_tensor(t) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def train(model: nn.Module, opt: Any, batches: List[tuple], framework: str) -> Tuple[List[float], ...]:
    """benchmarks/fsdp.py's step, except that the ShardedDataParallel rows clear gradients with
    the wrapper's own ``zero_grad()`` (FairScale's documented loop): FairScale's keeps the bucketed
    gradients as views of its buckets, and the optimizer's ``zero_grad(set_to_none=True)`` (torch's
    default since 2.0) detaches them, after which its second step trains on stale gradients.
    Returns per step: the step's seconds; the seconds of (zero_grad + forward, backward, optimizer
    step; for OSS the step includes the parameter exchange); the loss."""
    if framework in ("fairscale_c", "fairscale"):
        zero = model.zero_grad
    else:
        zero = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
    times, phases, losses = [], [], []
    for x, y in batches:
        t0 = time.perf_counter()
        zero()
        loss = model(x, y)
        tf = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        lv = loss.item()
        times.append(time.perf_counter() - t0)
        phases.append((tf - t0, t1 - tf, t2 - t1))
        losses.append(lv)
    return times, phases, losses


def rank_main(rank: int, world: int, framework: str, cfg_dict: Dict[str, Any], profile: Optional[str]) -> Dict:
    """One rank of a CPU run of `framework`; returns timings, losses, memory and state bytes."""
    cfg = base.Config(**cfg_dict)
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    batches = base.make_batches(cfg, rank, torch.device("cpu"))
    for name in MODULES[framework]:
        importlib.import_module(name)
    base._load_libraries("local")  # AdamW's first use and the model's code, before the baseline
    mem = base._Mem()
    torch.manual_seed(cfg.seed)
    model, opt = BUILDERS[framework](base.GPT(cfg), cfg)
    after_wrap = mem.read()
    times, phases, losses = train(model, opt, batches[: cfg.warmup], framework)
    mem.reset_peak()
    prof = None
    if profile and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t, ph, lo = train(model, opt, batches[cfg.warmup :], framework)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    end = mem.read()
    params = list(dict.fromkeys(model.parameters()))
    largest = max(params, key=lambda p: p.numel())
    dist.barrier()
    dist.destroy_process_group()
    return {
        "times": times + t,
        "phases": phases + ph,
        "losses": losses + lo,
        "peak_mib": (end["VmHWM"] - mem.base_kib) / 1024,
        "after_wrap_mib": (after_wrap["VmRSS"] - mem.base_kib) / 1024,
        "shmem_mib": end.get("RssShmem", 0) / 1024,
        **mem.end(end),
        "hwm_reset": mem.reset_ok,
        "state_bytes": state_bytes(local_optimizer(opt)),
        "largest_param_numel": largest.numel(),
        "param_numel": sum(p.numel() for p in params),
    }


def rank_main_paired(rank: int, world: int, frameworks: List[str], cfg_dict: Dict[str, Any]) -> Dict:
    """Timing only: every framework's model and optimizer in one process per rank, trained in
    turn, one step each per round, in the balanced orders of fsdp.py's `paired_orders`. Load from
    elsewhere on the machine then falls on every framework alike, where separate runs minutes apart
    see different loads. Before each framework's step the ranks meet at a gloo barrier (outside the
    timing): without it a framework would start while its peer was still in the previous
    framework's step and would pay for that skew, which the floor, whose ranks never synchronise,
    never does. Per step: time, phases, loss, this process's minor page faults and the CPU time of
    fairscale_c's progress threads (async ops; synchronous ones run on the calling thread). (Memory
    cannot be told apart here: rank_main measures it.)"""
    cfg = base.Config(**cfg_dict)
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    batches = base.make_batches(cfg, rank, torch.device("cpu"))
    built = {}
    for fw in frameworks:
        for name in MODULES[fw]:
            importlib.import_module(name)
        torch.manual_seed(cfg.seed)
        built[fw] = BUILDERS[fw](base.GPT(cfg), cfg)
    keys = ("times", "phases", "losses", "minflt", "engine_ms")
    out: Dict[str, Dict[str, list]] = {fw: {k: [] for k in keys} for fw in frameworks}
    orders = base.paired_orders(len(frameworks))
    for i, xy in enumerate(batches):
        for k in orders[i % len(orders)]:
            fw = frameworks[k]
            dist.barrier()
            f0, e0 = base._minor_faults(), base._engine_cpu_ns()
            t, ph, lo = train(*built[fw], [xy], fw)
            out[fw]["minflt"].append(base._minor_faults() - f0)
            out[fw]["engine_ms"].append((base._engine_cpu_ns() - e0) / 1e6)
            out[fw]["times"] += t
            out[fw]["phases"] += ph
            out[fw]["losses"] += lo
    dist.barrier()
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------- one rank on CUDA

# A CUDA run's bounds (seconds): torch's NCCL and fairscale_c's engine give up on a missing peer
# after CUDA_PEER_TIMEOUT_S; the driver gives up on one framework's run after CUDA_RUN_TIMEOUT_S.
CUDA_PEER_TIMEOUT_S = 120
CUDA_RUN_TIMEOUT_S = 300.0


def train_cuda(
    model: nn.Module, opt: Any, batches: List[tuple], framework: str, bf16: bool = False
) -> Tuple[List[float], ...]:
    """`train` on CUDA: the same step (with bf16 autocast around forward and loss when `bf16`).
    The step time is host time from a synchronised start to a synchronised end (after
    loss.item()); the phases are CUDA-event intervals on the current stream (zero_grad + forward,
    backward, optimizer step), which include the waits each framework puts on that stream for its
    communication."""
    if framework in ("fairscale_c", "fairscale"):
        zero = model.zero_grad
    else:
        zero = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
    times, phases, losses = [], [], []
    for x, y in batches:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev[0].record()
        zero()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt.step()
        ev[3].record()
        lv = loss.item()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        phases.append(tuple(a.elapsed_time(b) / 1e3 for a, b in zip(ev, ev[1:])))
        losses.append(lv)
    return times, phases, losses


def cuda_rank_main(
    rank: int, world: int, framework: str, cfg_dict: Dict[str, Any], bf16: bool, deterministic: bool = False
) -> Dict:
    """One rank of a CUDA run of `framework` (torch group on nccl; fairscale_c's groups are built
    from it and send CUDA tensors over their own NCCL communicators). Returns what rank_main
    returns, memory from torch.cuda: "peak_mib" = max_memory_allocated over the timed steps,
    "after_wrap_mib" = memory_allocated once the model and wrapper are built. `deterministic`:
    torch's deterministic kernels (cuBLAS's included), so that losses compare arithmetic, not
    run-to-run atomics."""
    import datetime

    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.use_deterministic_algorithms(True, warn_only=True)
        # the memory-efficient and flash attention backward kernels use atomics (warn_only lets
        # them run): the math kernel is deterministic
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    cfg = base.Config(**cfg_dict)
    torch.set_num_threads(cfg.threads)
    dev = rank_cuda_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=CUDA_PEER_TIMEOUT_S)
    )
    batches = base.make_batches(cfg, rank, dev)
    for name in MODULES[framework]:
        importlib.import_module(name)
    torch.manual_seed(cfg.seed)
    model, opt = BUILDERS[framework](base.GPT(cfg).to(dev), cfg)
    torch.cuda.synchronize()
    after_wrap = torch.cuda.memory_allocated()
    times, phases, losses = train_cuda(model, opt, batches[: cfg.warmup], framework, bf16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t, ph, lo = train_cuda(model, opt, batches[cfg.warmup :], framework, bf16)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    params = list(dict.fromkeys(model.parameters()))
    largest = max(params, key=lambda p: p.numel())
    dist.barrier(device_ids=[dev.index])
    dist.destroy_process_group()
    return {
        "times": times + t,
        "phases": phases + ph,
        "losses": losses + lo,
        "peak_mib": peak / 2**20,
        "after_wrap_mib": after_wrap / 2**20,
        "shmem_mib": 0.0,
        "hwm_reset": True,
        "state_bytes": state_bytes(local_optimizer(opt)),
        "largest_param_numel": largest.numel(),
        "param_numel": sum(p.numel() for p in params),
    }


# ---------------------------------------------------------------- reporting


def loss_diff(a: Dict, b: Dict) -> Tuple[float, float]:
    """Max |loss_a - loss_b| over steps and ranks, and that relative to |loss_b|."""
    absd, reld = [], []
    for la, lb in zip(a["losses"], b["losses"]):
        for x, y in zip(la, lb):
            if not (math.isnan(x) or math.isnan(y)):
                absd.append(abs(x - y))
                reld.append(abs(x - y) / max(abs(y), 1e-30))
    return (max(absd), max(reld)) if absd else (float("nan"), float("nan"))


def print_table(rows: List[Dict], floor: Dict, ref: Optional[Dict], mem_label: str = "peak RSS MiB per rank") -> None:
    head = (
        f"{'framework':<13}{'step ms':>9}{'fwd ms':>8}{'bwd ms':>8}{'opt ms':>8}{'own ms':>8}{'step/floor':>11}"
        f"{'own/FS':>8}"
        f"  {'optim state MiB per rank':<26}{mem_label:<23}{'max |dloss| vs FS':>18}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        own = r["step_ms"] - floor["step_ms"]
        own_fs = ref["step_ms"] - floor["step_ms"] if ref else float("nan")
        r["own_ms"] = own
        r["step_over_floor"] = r["step_ms"] / floor["step_ms"]
        r["own_over_fairscale"] = own / own_fs if ref and own_fs > 0 else float("nan")
        state = " / ".join(f"{b / 2**20:.1f}" for b in r["state_bytes"])
        peak = " / ".join(f"{m:.0f}" for m in r["peak_mib"])
        if ref is not None and r is not ref:
            r["max_loss_diff_vs_fairscale"], r["max_loss_rel_diff_vs_fairscale"] = loss_diff(r, ref)
            dl = f"{r['max_loss_diff_vs_fairscale']:.3g}"
        else:
            dl = "-"
        own_s = "-" if r is floor else f"{own:.1f}"
        skip = r is floor or r is ref or not ref or math.isnan(r["own_over_fairscale"])
        ratio = "-" if skip else f"{r['own_over_fairscale']:.2f}"
        print(
            f"{r['framework']:<13}{r['step_ms']:>9.1f}{r['fwd_ms']:>8.1f}{r['bwd_ms']:>8.1f}{r['opt_ms']:>8.1f}"
            f"{own_s:>8}{r['step_over_floor']:>11.3f}{ratio:>8}"
            f"  {state:<26}{peak:<23}{dl:>18}"
        )


def verdicts(rows: Dict[str, Dict], cfg: base.Config) -> Dict[str, Any]:
    """The target lines for fairscale_c (or why they cannot be judged)."""
    out: Dict[str, Any] = {}
    ours, floor, ref = rows.get("fairscale_c"), rows["local"], rows.get(REFERENCE)
    if ours is None:
        print("targets: not judged (no fairscale_c row)")
        return out
    # Paired: decided on the median of the per-step ratios (each step against the floor's step of
    # the same round, as benchmarks/fsdp.py decides); otherwise on the ratio of the median steps.
    paired = "paired_step_ratio_to_floor" in ours
    over = ours["paired_step_ratio_to_floor"] if paired else ours["step_ms"] / floor["step_ms"]
    out["target_step_met"] = over <= TARGET_STEP_OVER_FLOOR
    total_state = max(floor["state_bytes"])  # the unsharded AdamW state
    per_param = total_state / floor["param_numel"][0]  # state bytes per parameter element
    bound = total_state / cfg.world + per_param * floor["largest_param_numel"][0]
    out["state_bound_bytes"] = bound
    out["target_state_met"] = max(ours["state_bytes"]) <= bound
    line = (
        f"target step <= {TARGET_STEP_OVER_FLOOR}x the floor: {'met' if out['target_step_met'] else 'NOT met'} "
        f"({over:.3f}x{', median per-step ratio' if paired else ''}); "
        f"optimizer state per rank <= 1/{cfg.world} + one parameter's share: "
        f"{'met' if out['target_state_met'] else 'NOT met'} "
        f"({max(ours['state_bytes']) / 2**20:.1f} <= {bound / 2**20:.1f} MiB)"
    )
    if ref is None:
        print(line + f"; own time and losses vs FairScale: not judged ({REFERENCE} row missing)")
        return out
    own, own_fs = ours["step_ms"] - floor["step_ms"], ref["step_ms"] - floor["step_ms"]
    per_step = ours.get("paired_own_ratio_to_fairscale")
    if paired:
        out["target_own_time_met"] = per_step is not None and per_step <= TARGET_OWN_VS_FAIRSCALE
    else:
        out["target_own_time_met"] = own_fs > 0 and own <= TARGET_OWN_VS_FAIRSCALE * own_fs
    # The floor's AdamW steps every parameter; a sharded optimizer steps 1/world of them. The
    # floor with its measured optimizer step cut to that share is the tighter reference.
    adj = floor["step_ms"] - floor["opt_ms"] * (1 - 1 / cfg.world)
    own_adj, own_fs_adj = ours["step_ms"] - adj, ref["step_ms"] - adj
    out.update(floor_adjusted_ms=adj, own_ms_adjusted=own_adj, fairscale_own_ms_adjusted=own_fs_adj)
    out["target_own_time_adjusted_met"] = own_fs_adj > 0 and own_adj <= TARGET_OWN_VS_FAIRSCALE * own_fs_adj
    absd, reld = loss_diff(ours, ref)
    out["max_loss_diff_vs_fairscale"], out["max_loss_rel_diff_vs_fairscale"] = absd, reld
    out["target_loss_met"] = reld <= LOSS_RTOL
    print(line)
    print(
        f"floor with its optimizer step cut to 1/{cfg.world} (the share a sharded optimizer steps): {adj:.1f} ms "
        f"(local's AdamW step: {floor['opt_ms']:.1f} ms); own time above it: fairscale_c {own_adj:.1f} ms, "
        f"FairScale {own_fs_adj:.1f} ms"
    )
    if paired:
        judged = "met" if out["target_own_time_met"] else ("NOT met" if per_step is not None else "not judgeable")
        if per_step is not None:
            lo, hi = ours["paired_own_ratio_quartiles"]
            judged += (
                f" (median per-step ratio {per_step:.3f} [{lo:.3f}-{hi:.3f}] over "
                f"{ours['paired_own_ratio_steps']} steps with FairScale's own time > 0)"
            )
        else:
            judged += " (FairScale's own time was never positive)"
        judged += "; medians of the steps"
    else:
        judged = "met" if out["target_own_time_met"] else ("NOT met" if own_fs > 0 else "not judgeable")
    judged_adj = "met" if out["target_own_time_adjusted_met"] else "NOT met"
    print(
        f"target own time <= {TARGET_OWN_VS_FAIRSCALE}x FairScale's: {judged} ({own:.1f} vs {own_fs:.1f} ms"
        + ("; FairScale's own time is not positive" if own_fs <= 0 else "")
        + f"); above the adjusted floor: {judged_adj} ({own_adj:.1f} vs {own_fs_adj:.1f} ms); "
        f"losses within fp32 rounding of FairScale's (relative {LOSS_RTOL:g}): "
        f"{'met' if out['target_loss_met'] else 'NOT met'} (max |dloss| {absd:.3g}, relative {reld:.3g})"
    )
    return out


def _row(fw: str, runs: List[List[Dict]], cfg: base.Config) -> Dict[str, Any]:
    """One framework's row from its runs (each a list of rank results): the step and phase times
    are medians over the timed steps of all runs (per step the slowest rank counts); memory is the
    largest over runs; losses are the first run's (every run trains the same steps)."""
    timed = range(cfg.warmup, cfg.warmup + cfg.steps)
    row = base.summarize(fw, runs[0], cfg)
    row["runs"] = len(runs)
    steps = [max(r["times"][i] for r in ranks) for ranks in runs for i in timed]
    row["step_ms"] = statistics.median(steps) * 1e3
    row["step_ms_each"] = [t * 1e3 for t in steps]
    row["step_ms_per_run"] = [
        statistics.median(max(r["times"][i] for r in ranks) for i in timed) * 1e3 for ranks in runs
    ]
    row["tokens_per_s"] = cfg.world * cfg.batch * cfg.seq / (row["step_ms"] / 1e3)
    for k, name in enumerate(("fwd_ms", "bwd_ms", "opt_ms")):
        row[name] = statistics.median(max(r["phases"][i][k] for r in ranks) for ranks in runs for i in timed) * 1e3
    for key in ("peak_mib", "after_wrap_mib", "shmem_mib", "end_rss_mib", "end_split_mib"):
        if all(key in ranks[rank] for ranks in runs for rank in range(cfg.world)):
            row[key] = [max(ranks[rank][key] for ranks in runs) for rank in range(cfg.world)]
    for key in ("state_bytes", "largest_param_numel", "param_numel"):
        row[key] = [r[key] for r in runs[0]]
    row["hwm_reset"] = all(r["hwm_reset"] for ranks in runs for r in ranks)
    return row


def _apply_paired(rows: Dict[str, Dict], ranks: List[Dict[str, Dict]], cfg: base.Config) -> None:
    """Replace the rows' times by the paired run's (keeping the separate runs' as *_separate) and
    add each framework's median per-step ratio to the floor's step."""
    timed = range(cfg.warmup, cfg.warmup + cfg.steps)
    floor_steps = [max(r["local"]["times"][i] for r in ranks) for i in timed]
    for fw, row in rows.items():
        for key in ("step_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms_each"):
            row[key + "_separate"] = row[key]
        steps = [max(r[fw]["times"][i] for r in ranks) for i in timed]
        row["step_ms"] = statistics.median(steps) * 1e3
        row["step_ms_each"] = [t * 1e3 for t in steps]
        row["tokens_per_s"] = cfg.world * cfg.batch * cfg.seq / (row["step_ms"] / 1e3)
        for k, name in enumerate(("fwd_ms", "bwd_ms", "opt_ms")):
            row[name] = statistics.median(max(r[fw]["phases"][i][k] for r in ranks) for i in timed) * 1e3
        row["paired_step_ratio_to_floor"] = statistics.median(a / b for a, b in zip(steps, floor_steps))
        row["paired_own_ms_each"] = [(a - b) * 1e3 for a, b in zip(steps, floor_steps)]
        row["paired_minflt"] = statistics.median(statistics.mean(r[fw]["minflt"][i] for r in ranks) for i in timed)
        row["paired_engine_cpu_ms"] = statistics.median(max(r[fw]["engine_ms"][i] for r in ranks) for i in timed)
        row["paired_losses_equal_separate"] = [r[fw]["losses"] for r in ranks] == row["losses"]
        row["timing"] = "paired"
    ours, ref = rows.get("fairscale_c"), rows.get(REFERENCE)
    if ours is not None and ref is not None:
        ratios = [a / b for a, b in zip(ours["paired_own_ms_each"], ref["paired_own_ms_each"]) if b > 0]
        ours["paired_own_ratio_steps"] = len(ratios)
        if ratios:
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            ours["paired_own_ratio_to_fairscale"] = statistics.median(ratios)
            ours["paired_own_ratio_quartiles"] = [q[0], q[2]]


def run_cpu(
    cfg: base.Config,
    frameworks: List[str],
    profile: Optional[str],
    repeats: int = 1,
    paired: bool = True,
    paired_malloc: str = "kept",
) -> Dict[str, Any]:
    """Every framework once per round, `repeats` rounds (interleaved, so that a burst of load on
    the machine falls on one run of each framework rather than on all runs of one): memory,
    optimizer state, losses and (without `paired`) times. With `paired`, the times come from one
    more run in which every framework trains in turn in the same processes (rank_main_paired),
    with fsdp.py's glibc settings PAIRED_MALLOC[paired_malloc]."""
    runs: Dict[str, List[List[Dict]]] = {}
    skipped: Dict[str, str] = {}
    for fw in frameworks:
        why = unavailable(fw)
        if why is not None:
            skipped[fw] = why
            print(f"[cpu] {fw}: SKIPPED, {why}", flush=True)
    for rnd in range(repeats):
        for fw in frameworks:
            if fw in skipped:
                continue
            t0 = time.perf_counter()
            prof = profile if fw == "fairscale_c" and rnd == repeats - 1 else None
            ranks = base.spawn(rank_main, cfg.world, fw, asdict(cfg), prof)
            runs.setdefault(fw, []).append(ranks)
            print(f"[cpu] round {rnd + 1}/{repeats} {fw}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = {fw: _row(fw, r, cfg) for fw, r in runs.items()}
    if paired:
        t0 = time.perf_counter()
        fws = [fw for fw in frameworks if fw in rows]
        with base.malloc_env(paired_malloc):
            ranks = base.spawn(rank_main_paired, cfg.world, fws, asdict(cfg))
        print(f"[cpu] paired timing run ({', '.join(fws)} in turn): done in {time.perf_counter() - t0:.1f} s")
        _apply_paired(rows, ranks, cfg)
    n = base.n_params(cfg)
    print(
        f"\nCPU, world {cfg.world} (gloo; fairscale_c on its shared-memory engine), fp32 AdamW, "
        f"{cfg.threads} thread(s) per rank, {n / 1e6:.2f}M params, median of {cfg.steps} steps after "
        f"{cfg.warmup} warm-up; "
        + (
            "times from one run training every framework in turn, step by step, in the same processes "
            f"(malloc: {base.PAIRED_MALLOC[paired_malloc] or 'glibc defaults'}); "
            f"memory from {repeats} separate run(s) per framework"
            if paired
            else f"{repeats} separate run(s) per framework, interleaved"
        )
        + "; floor = local (each rank trains an unsharded copy, no communication)"
    )
    if "local" not in rows:
        raise RuntimeError("the local row (the compute floor) is required")
    order = [rows[f] for f in frameworks if f in rows]
    print_table(order, rows["local"], rows.get(REFERENCE))
    if paired:
        print(
            "paired: median per-step ratio to the floor's step: "
            + ", ".join(f"{r['framework']} {r['paired_step_ratio_to_floor']:.3f}" for r in order)
        )
        print(
            "paired: minor page faults per step (median of the ranks' mean): "
            + ", ".join(f"{r['framework']} {r['paired_minflt']:.0f}" for r in order)
        )
        print(
            "paired: fairscale_c's progress threads, ms CPU per step (median of the slowest rank's): "
            + ", ".join(f"{r['framework']} {r['paired_engine_cpu_ms']:.1f}" for r in order)
        )
        print(
            "separate runs' medians (ms), for comparison: "
            + ", ".join(f"{r['framework']} {r['step_ms_separate']:.1f}" for r in order)
        )
    line = base.memory_end_line(order)
    if line:
        print(line)
    _print_run_notes(order, rows, repeats, skipped, {})
    result: Dict[str, Any] = {"rows": order, "skipped": skipped}
    if paired:
        result["paired_malloc"] = {"setting": paired_malloc, "glibc_tunables": base.PAIRED_MALLOC[paired_malloc]}
    result.update(verdicts(rows, cfg))
    if not all(r["hwm_reset"] for r in order):
        print("note: /proc/self/clear_refs was not writable; peaks include model construction")
    return result


def _print_run_notes(
    order: List[Dict], rows: Dict[str, Dict], repeats: int, skipped: Dict[str, str], failed: Dict[str, str]
) -> None:
    """The lines under the table: each run's median step (with several runs), frameworks skipped
    or failed, and how far plain DDP's losses are from FairScale's (the scale of rounding)."""
    if repeats > 1:
        for r in order:
            per_run = ", ".join(f"{t:.1f}" for t in r["step_ms_per_run"])
            print(f"  {r['framework']}: median step per run {per_run} ms")
    for fw, why in skipped.items():
        print(f"{fw}: skipped ({why})")
    for fw, err in failed.items():
        print(f"{fw}: FAILED ({err})")
    if "ddp" in rows and REFERENCE in rows:
        absd, reld = loss_diff(rows["ddp"], rows[REFERENCE])
        print(f"for scale: plain DDP's losses differ from FairScale's by up to {absd:.3g} (relative {reld:.3g})")


def run_cuda(
    cfg: base.Config, frameworks: List[str], repeats: int, bf16: bool, note: str, deterministic: bool = False
) -> Dict[str, Any]:
    """The CUDA counterpart of run_cpu: every framework once per round, `repeats` rounds, each run a
    fresh set of `cfg.world` processes (cuda_rank_main); no paired run (all models in one process
    per rank would not fit the larger presets twice on one GPU, and the host load that pairing
    evens out matters less when the GPU does the work). A framework other than the floor that
    fails (or hangs past CUDA_RUN_TIMEOUT_S) is reported and left out; the others still run."""
    os.environ.setdefault("FAIRSCALE_C_TIMEOUT", str(CUDA_PEER_TIMEOUT_S))  # inherited by the ranks
    runs: Dict[str, List[List[Dict]]] = {}
    skipped: Dict[str, str] = {}
    failed: Dict[str, str] = {}
    for fw in frameworks:
        why = unavailable(fw)
        if why is not None:
            skipped[fw] = why
            print(f"[cuda] {fw}: SKIPPED, {why}", flush=True)
    for rnd in range(repeats):
        for fw in frameworks:
            if fw in skipped or fw in failed:
                continue
            t0 = time.perf_counter()
            try:
                ranks = base.spawn(
                    cuda_rank_main, cfg.world, fw, asdict(cfg), bf16, deterministic, timeout=CUDA_RUN_TIMEOUT_S
                )
            except RuntimeError as e:
                if fw == "local":
                    raise
                failed[fw] = str(e).strip().splitlines()[-1]
                print(f"[cuda] round {rnd + 1}/{repeats} {fw}: FAILED ({failed[fw]})\n{e}", flush=True)
                continue
            runs.setdefault(fw, []).append(ranks)
            print(f"[cuda] round {rnd + 1}/{repeats} {fw}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = {fw: _row(fw, r, cfg) for fw, r in runs.items() if fw not in failed}
    n = base.n_params(cfg)
    kernels = ", deterministic kernels" if deterministic else ""
    print(
        f"\nCUDA, world {cfg.world} ({note}); FairScale, ZeRO, DDP on torch's nccl, fairscale_c on its own NCCL "
        f"communicators; {'bf16 autocast' if bf16 else 'fp32'}{kernels}, AdamW, {n / 1e6:.2f}M params, "
        f"{cfg.batch} x {cfg.seq} tokens per rank per step, median of {cfg.steps} steps after {cfg.warmup} warm-up, "
        f"{repeats} separate run(s) per framework; floor = local (each rank trains an unsharded copy, no "
        "communication); phases: CUDA events on the compute stream; memory: torch.cuda.max_memory_allocated"
    )
    order = [rows[f] for f in frameworks if f in rows]
    print_table(order, rows["local"], rows.get(REFERENCE), mem_label="CUDA peak MiB per rank")
    _print_run_notes(order, rows, repeats, skipped, failed)
    result: Dict[str, Any] = {"rows": order, "skipped": skipped, "failed": failed}
    result.update(verdicts(rows, cfg))
    if bf16:
        print(
            "note: the loss target is fp32's; under bf16 autocast the frameworks' losses differ by bf16 rounding "
            "(compare with the DDP line above)"
        )
    elif not deterministic:
        print(
            "note: without --deterministic, CUDA kernels that accumulate with atomics make every run's losses "
            "drift from any other's; the loss target then also measures that"
        )
    return result


# ---------------------------------------------------------------- main


def parse_args(argv: Optional[List[str]] = None) -> tuple:
    d = default_config()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (under a minute)")
    p.add_argument("--world", type=int, default=d.world)
    for name, what in (
        ("steps", "timed steps"),
        ("warmup", "untimed steps first"),
        ("layers", None),
        ("d-model", None),
        ("heads", None),
        ("seq", None),
        ("vocab", None),
        ("batch", "sequences per rank per step"),
    ):
        p.add_argument(f"--{name}", type=int, default=None, help=what)
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / world)")
    p.add_argument(
        "--frameworks",
        default=",".join(FRAMEWORKS),
        help=f"comma-separated subset of {','.join(FRAMEWORKS)} (local is always run)",
    )
    p.add_argument("--repeats", type=int, default=1, help="rounds of separate runs (every framework once per round)")
    p.add_argument(
        "--no-paired",
        action="store_true",
        help="take times from the separate runs instead of a run that trains every framework in turn",
    )
    p.add_argument(
        "--paired-malloc",
        choices=sorted(base.PAIRED_MALLOC),
        default="kept",
        help="glibc malloc settings of the paired run's processes (as benchmarks/fsdp.py's): 'kept' (default) "
        "or 'default'",
    )
    p.add_argument(
        "--profile", metavar="FILE", help="cProfile rank 0 of fairscale_c's timed steps (last round) into FILE"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (gloo; fairscale_c on its shared-memory engine) or cuda (NCCL; rank r on cuda:r %% device_count, "
        "two ranks may share one GPU with NCCL >= 2.30)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(CUDA_PRESETS),
        default=None,
        help="--device cuda: the model (default 125m: 12 x 768; 350m: 24 x 1024; vocab 50304, seq 512, batch 8); "
        "--layers etc. override its fields",
    )
    p.add_argument("--bf16", action="store_true", help="--device cuda: bf16 autocast of forward and loss")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="--device cuda: torch.use_deterministic_algorithms and math attention in every rank, so the loss "
        "comparison sees the frameworks' arithmetic rather than run-to-run atomics (kernels may be slower)",
    )
    p.add_argument("--out", default=None, help=f"JSON results path (default {RESULTS}, or {RESULTS_CUDA} for cuda)")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    if not cuda:
        cuda_only = (("--preset", a.preset is not None), ("--bf16", a.bf16), ("--deterministic", a.deterministic))
        for flag, given in cuda_only:
            if given:
                p.error(f"{flag} is for --device cuda (the CPU run is fp32 on the default or --quick model)")
    elif a.profile:
        p.error("--profile is for the CPU run")
    elif a.quick and a.preset is not None:
        p.error("--quick and --preset choose different models: give one")
    if a.out is None:
        a.out = RESULTS_CUDA if cuda else RESULTS
    if a.quick:
        cfg = base.quick_config()
    else:
        cfg = cuda_config(a.preset or "125m") if cuda else d
    for name in ("steps", "warmup", "layers", "d_model", "heads", "seq", "vocab", "batch"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    cfg.world = a.world
    cfg.threads = a.threads if a.threads else max(1, (os.cpu_count() or 1) // cfg.world)
    if cfg.d_model % cfg.heads:
        p.error("--d-model must be a multiple of --heads")
    if cfg.world < 2:
        p.error("--world must be at least 2")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    fws = [f.strip() for f in a.frameworks.split(",") if f.strip()]
    bad = [f for f in fws if f not in FRAMEWORKS]
    if bad:
        p.error(f"--frameworks: unknown {bad}; choose from {list(FRAMEWORKS)}")
    if "local" not in fws:
        fws.append("local")
    return a, cfg, [f for f in FRAMEWORKS if f in fws]


def main(argv: Optional[List[str]] = None) -> int:
    args, cfg, frameworks = parse_args(argv)
    cuda_note = check_cuda_ranks(cfg.world) if args.device == "cuda" else None  # exits when CUDA cannot run
    print(f"config: {asdict(cfg)}; torch {torch.__version__}; {os.cpu_count()} CPU cores", flush=True)
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    result: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "config": asdict(cfg),
        "params": base.n_params(cfg),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
        "load_avg_at_start": load,
    }
    if importlib.util.find_spec("fairscale") is not None:
        import fairscale

        result["fairscale"] = fairscale.__version__
    if cuda_note is None:
        result["cpu"] = run_cpu(
            cfg, frameworks, args.profile, args.repeats, paired=not args.no_paired, paired_malloc=args.paired_malloc
        )
    else:
        result.update(
            cuda_info(), device="cuda", cuda_ranks=cuda_note, bf16_autocast=args.bf16, deterministic=args.deterministic
        )
        result["preset"] = "quick" if args.quick else (args.preset or "125m")
        print(f"[cuda] {cuda_note} ({result['gpu']})", flush=True)
        if args.no_paired:
            print("[cuda] note: --no-paired changes nothing here (CUDA runs are always separate)")
        result["cuda"] = run_cuda(cfg, frameworks, args.repeats, args.bf16, cuda_note, args.deterministic)
    try:
        result["load_avg_at_end"] = os.getloadavg()
    except OSError:
        pass
    print(f"load average at start {load[0]:.2f}, at end {result.get('load_avg_at_end', (float('nan'),))[0]:.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
