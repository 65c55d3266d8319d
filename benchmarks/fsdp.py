"""FSDP benchmark: fairscale_c.nn.FullyShardedDataParallel vs PyTorch's FSDP2 on a GPT-style model.

CPU (always): `--world` ranks as spawned processes on gloo, one fresh set of processes per
framework so neither inflates the other's memory high-water mark. Both frameworks wrap every
transformer block, then the root; same init, data, AdamW settings and number of steps.

    PYTHONPATH=. python benchmarks/fsdp.py            # default model, fp32
    PYTHONPATH=. python benchmarks/fsdp.py --bf16     # bf16 mixed precision on both
    PYTHONPATH=. python benchmarks/fsdp.py --quick    # tiny model, a few steps (< 1 minute)

Reported per framework: median step time over the timed steps (a step is zero_grad + forward +
loss + backward + optimizer step; per step the slowest rank counts), tokens/s over all ranks,
and per rank the peak resident-set growth (see `_Mem`). The per-step losses of the two
frameworks are compared as a guard against timing a broken run.

CUDA (only when `torch.cuda.is_available()`, see `run_cuda`): the same on NCCL, plus FairScale
0.4.13's FSDP when `fairscale` is importable; memory is torch.cuda.max_memory_allocated.

Results go to stdout (a table) and benchmarks/results/fsdp.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fsdp.json")
BASELINE = "torch_fsdp2"
# CPU targets. The compute floor (the "local" row: every rank trains an unsharded copy, no
# communication) is the reference: the step within 2% of it, and fairscale_c's own time (its step
# above the floor) at most a tenth of FSDP2's own time. Peak memory at most FSDP2's.
TARGET_STEP_OVER_FLOOR = 1.02
TARGET_OWN_VS_FSDP2 = 0.1
TARGET_MEM_RATIO = 1.0


# ---------------------------------------------------------------- model


@dataclass
class Config:
    layers: int = 4
    d_model: int = 256
    heads: int = 4
    seq: int = 256
    vocab: int = 8192
    batch: int = 8  # sequences per rank per step
    steps: int = 20
    warmup: int = 3
    world: int = 2
    threads: int = 1  # torch intra-op threads per rank
    bf16: bool = False
    bucket_cap_mb: float = 25  # fairscale_c's reduce-scatter bucket (FairScale's default)
    shared_rs_group: bool = False  # fairscale_c: reduce-scatter on the all-gather group
    lr: float = 1e-3
    seed: int = 0


def quick_config() -> Config:
    """The small model of --quick (0.14M parameters), also the one benchmarks/test_bench_fsdp.py trains."""
    return Config(layers=2, d_model=64, heads=2, seq=64, vocab=512, batch=4, steps=5, warmup=2)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention then a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, 3c) -> 3 x (b, heads, t, c / heads)
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token embedding + learned positions, `layers` blocks, final LN, output head tied to the embedding."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def n_params(cfg: Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def make_batches(cfg: Config, rank: int, device: torch.device) -> List[tuple]:
    """Token sequences, different per rank and per step, identical across frameworks."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    pos = torch.arange(cfg.seq + 1)
    out = []
    for _ in range(cfg.warmup + cfg.steps):
        # Arithmetic sequences (random start and stride per row): learnable in context, so the loss
        # falls within a few steps and the loss comparison has something to compare.
        start = torch.randint(cfg.vocab, (cfg.batch, 1), generator=g)
        stride = torch.randint(1, 8, (cfg.batch, 1), generator=g)
        tokens = (start + stride * pos) % cfg.vocab
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


# ---------------------------------------------------------------- wrapping


def wrap_fairscale_c(model: GPT, cfg: Config) -> nn.Module:
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn.wrap import enable_wrap, wrap

    kwargs: Dict[str, Any] = {"mixed_precision": True, "compute_dtype": torch.bfloat16} if cfg.bf16 else {}
    kwargs["bucket_cap_mb"] = cfg.bucket_cap_mb
    if cfg.shared_rs_group:
        kwargs["process_group_reduce_scatter"] = "default"
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        model.blocks = nn.ModuleList(wrap(b) for b in model.blocks)
    return FSDP(model, **kwargs)


def wrap_fairscale(model: GPT, cfg: Config) -> nn.Module:
    """FairScale 0.4.13 itself (CUDA path only)."""
    from fairscale.nn import FullyShardedDataParallel as FSDP
    from fairscale.nn.wrap import enable_wrap, wrap

    kwargs: Dict[str, Any] = {"mixed_precision": True, "compute_dtype": torch.bfloat16} if cfg.bf16 else {}
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        model.blocks = nn.ModuleList(wrap(b) for b in model.blocks)
    return FSDP(model, **kwargs)


def wrap_torch_fsdp2(model: GPT, cfg: Config) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16 reduce as well: fairscale_c with mixed_precision=True reduce-scatters in the compute
    # dtype (fp32_reduce_scatter=False, FairScale's default), so both move the same bytes.
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if cfg.bf16 else None
    kwargs: Dict[str, Any] = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def wrap_local(model: GPT, cfg: Config) -> nn.Module:
    """No sharding and no communication: every rank trains its own full copy on its own batch (in
    bf16 for --bf16, as the FSDP runs compute). Not a competitor but the compute floor: the
    model's forward, backward and optimizer step with nothing a framework adds (its optimizer
    step covers all parameters, not a 1/world shard, so it is a slight over-estimate)."""
    return model.to(torch.bfloat16) if cfg.bf16 else model


WRAPPERS = {
    "torch_fsdp2": wrap_torch_fsdp2,
    "fairscale_c": wrap_fairscale_c,
    "fairscale": wrap_fairscale,
    "local": wrap_local,
}


# ---------------------------------------------------------------- one rank


class _Mem:
    """Host memory of this process from /proc/self/status (KiB).

    The peak reported is VmHWM at the end of the timed steps minus VmRSS before the model is built
    (libraries already loaded, see `_load_libraries`), with the high-water mark reset (writing 5 to
    /proc/self/clear_refs) after the warm-up steps. So it is the worst moment of steady-state
    training (shards, gathered parameters, activations, gradients, optimizer state, shared-memory
    pages of the collective engine touched by this rank) above the pre-model baseline; the
    transient full-model copy both frameworks build before sharding is left out. Memory the
    allocator keeps after a free still counts, as it does for any RSS figure."""

    def __init__(self) -> None:
        self.base_kib = self.read()["VmRSS"]
        self.reset_ok = False

    @staticmethod
    def read() -> Dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0])
        return out

    def reset_peak(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False  # peak then includes model construction; said in the result


def _load_libraries(framework: str) -> None:
    """Import and run once everything a step uses, so the memory baseline taken next already holds
    library code and lazily imported modules (AdamW's first use pulls in torch._dynamo: ~40 MiB)."""
    modules = {
        "fairscale_c": "fairscale_c.nn.wrap",
        "torch_fsdp2": "torch.distributed.fsdp",
        "fairscale": "fairscale.nn",
        "local": "torch.nn",
    }
    importlib.import_module(modules[framework])
    tiny = GPT(Config(layers=1, d_model=8, heads=2, seq=4, vocab=16))
    opt = torch.optim.AdamW(tiny.parameters())
    tiny(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: List[tuple], sync) -> tuple:
    times, losses = [], []
    for x, y in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        lv = loss.item()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(lv)
    return times, losses


def rank_main(rank: int, world: int, framework: str, cfg_dict: Dict[str, Any], profile: Optional[str]) -> Dict:
    """One rank of a CPU (gloo) run of `framework`; returns its timings, losses and memory."""
    cfg = Config(**cfg_dict)
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    batches = make_batches(cfg, rank, torch.device("cpu"))
    _load_libraries(framework)
    mem = _Mem()
    torch.manual_seed(cfg.seed)
    model = WRAPPERS[framework](GPT(cfg), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    after_wrap = mem.read()
    times, losses = _train(model, opt, batches[: cfg.warmup], lambda: None)
    mem.reset_peak()
    prof = None
    if profile and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t, lo = _train(model, opt, batches[cfg.warmup :], lambda: None)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    times, losses = times + t, losses + lo
    end = mem.read()
    dist.barrier()
    dist.destroy_process_group()
    return {
        "times": times,
        "losses": losses,
        "peak_mib": (end["VmHWM"] - mem.base_kib) / 1024,
        "after_wrap_mib": (after_wrap["VmRSS"] - mem.base_kib) / 1024,
        "shmem_mib": end.get("RssShmem", 0) / 1024,
        "hwm_reset": mem.reset_ok,
    }


# ---------------------------------------------------------------- spawning


def _entry(fn, rank: int, world: int, port: int, q: Any, args: tuple) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        q.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def spawn(fn, world: int, *args: Any, timeout: float = 1800) -> List[Dict]:
    """Run module-level `fn(rank, world, *args)` in `world` fresh processes; results by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(world)) - set(results))} did not finish in {timeout} s")
            try:
                rank, ok, value = q.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    codes = [procs[r].exitcode for r in dead]
                    raise RuntimeError(f"rank(s) {dead} died (exit codes {codes})") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]


# ---------------------------------------------------------------- reporting


def summarize(framework: str, ranks: List[Dict], cfg: Config) -> Dict[str, Any]:
    # A step ends for the job when its slowest rank ends.
    per_step = [max(r["times"][i] for r in ranks) for i in range(cfg.warmup, cfg.warmup + cfg.steps)]
    per_step = [t for t in per_step if not math.isnan(t)]
    step_s = statistics.median(per_step)
    return {
        "framework": framework,
        "step_ms": step_s * 1e3,
        "step_ms_each": [t * 1e3 for t in per_step],
        "tokens_per_s": cfg.world * cfg.batch * cfg.seq / step_s,
        "peak_mib": [r["peak_mib"] for r in ranks],
        "after_wrap_mib": [r["after_wrap_mib"] for r in ranks],
        "shmem_mib": [r["shmem_mib"] for r in ranks],
        "hwm_reset": all(r["hwm_reset"] for r in ranks),
        "losses": [r["losses"] for r in ranks],
    }


def max_loss_diff(a: Dict, b: Dict) -> float:
    diffs = [abs(x - y) for la, lb in zip(a["losses"], b["losses"]) for x, y in zip(la, lb)]
    diffs = [d for d in diffs if not math.isnan(d)]
    return max(diffs) if diffs else float("nan")


def print_table(rows: List[Dict], mem_label: str) -> None:
    base = next((r for r in rows if r["framework"] == BASELINE), None)
    mem_head = mem_label + " per rank"
    head = f"{'framework':<14}{'step ms':>10}{'tokens/s':>11}  {mem_head:<24}{'step/FSDP2':>11}{'mem/FSDP2':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        mem = " / ".join(f"{m:.0f}" for m in r["peak_mib"])
        sr = r["step_ms"] / base["step_ms"] if base else float("nan")
        mr = max(r["peak_mib"]) / max(base["peak_mib"]) if base else float("nan")
        r["step_ratio_vs_fsdp2"], r["mem_ratio_vs_fsdp2"] = sr, mr
        print(f"{r['framework']:<14}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11.0f}  {mem:<24}{sr:>11.2f}{mr:>11.2f}")


def run_cpu(cfg: Config, profile: Optional[str]) -> Dict[str, Any]:
    rows = []
    for fw in ("torch_fsdp2", "fairscale_c", "local"):
        t0 = time.perf_counter()
        ranks = spawn(rank_main, cfg.world, fw, asdict(cfg), profile if fw == "fairscale_c" else None)
        rows.append(summarize(fw, ranks, cfg))
        print(f"[cpu] {fw}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    print(
        f"\nCPU, gloo, world {cfg.world}, {'bf16 mixed precision' if cfg.bf16 else 'fp32'}, "
        f"{cfg.threads} thread(s) per rank, {n_params(cfg) / 1e6:.2f}M params, "
        f"median of {cfg.steps} steps after {cfg.warmup} warm-up"
    )
    print_table(rows, "peak RSS growth MiB")
    diff = max_loss_diff(rows[0], rows[1])
    print(f"max |loss(fairscale_c) - loss(torch_fsdp2)| over steps and ranks: {diff:.3g}")
    fc, local = rows[1], rows[2]
    own_ours, own_fsdp2 = fc["step_ms"] - local["step_ms"], rows[0]["step_ms"] - local["step_ms"]
    over_floor = fc["step_ms"] / local["step_ms"]
    met_step = over_floor <= TARGET_STEP_OVER_FLOOR
    met_own = own_fsdp2 > 0 and own_ours <= TARGET_OWN_VS_FSDP2 * own_fsdp2
    met_mem = fc["mem_ratio_vs_fsdp2"] <= TARGET_MEM_RATIO
    floor = local["step_ratio_vs_fsdp2"]
    print(
        f"compute floor (local: each rank trains an unsharded copy, no communication): {floor:.2f}x FSDP2's step; "
        f"fairscale_c's own time above it: {own_ours:.1f} ms, FSDP2's: {own_fsdp2:.1f} ms"
    )
    print(
        f"target step <= {TARGET_STEP_OVER_FLOOR}x the floor: {'met' if met_step else 'NOT met'} ({over_floor:.3f}x); "
        f"own time <= {TARGET_OWN_VS_FSDP2}x FSDP2's: {'met' if met_own else 'NOT met'} "
        f"({own_ours:.1f} vs {own_fsdp2:.1f} ms); peak memory <= FSDP2: {'met' if met_mem else 'NOT met'} "
        f"({fc['mem_ratio_vs_fsdp2']:.2f}x)"
    )
    if not all(r["hwm_reset"] for r in rows):
        print("note: /proc/self/clear_refs was not writable; peaks include model construction")
    return {
        "rows": rows,
        "max_loss_diff": diff,
        "target_step_met": met_step,
        "target_own_time_met": met_own,
        "target_mem_met": met_mem,
        "compute_floor_vs_fsdp2": floor,
    }


# ---------------------------------------------------------------- CUDA (NCCL), separate and optional


def cuda_rank_main(rank: int, world: int, framework: str, cfg_dict: Dict[str, Any]) -> Dict:
    """One rank of a CUDA (NCCL) run; memory is torch.cuda.max_memory_allocated during training."""
    cfg = Config(**cfg_dict)
    dev = torch.device("cuda", rank % torch.cuda.device_count())  # ranks share GPUs only by opt-in
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    batches = make_batches(cfg, rank, dev)
    torch.manual_seed(cfg.seed)
    model = WRAPPERS[framework](GPT(cfg).to(dev), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = _train(model, opt, batches, torch.cuda.synchronize)
    peak = torch.cuda.max_memory_allocated() / 2**20
    dist.barrier()
    dist.destroy_process_group()
    return {
        "times": times,
        "losses": losses,
        "peak_mib": peak,
        "after_wrap_mib": float("nan"),
        "shmem_mib": 0.0,
        "hwm_reset": True,
    }


def run_cuda(cfg: Config) -> Optional[Dict[str, Any]]:
    if not torch.cuda.is_available():
        print("[cuda] skipped: torch.cuda.is_available() is False")
        return None
    shared = torch.cuda.device_count() < cfg.world
    if shared and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        print("[cuda] skipped: needs --world GPUs, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1")
        return None
    if shared:
        print(f"[cuda] note: {cfg.world} ranks share {torch.cuda.device_count()} GPU(s); step times include that")
    frameworks = ["torch_fsdp2", "fairscale_c"]
    try:
        import fairscale.nn  # noqa: F401

        frameworks.append("fairscale")
    except ImportError:
        print("[cuda] fairscale not importable; comparing fairscale_c with FSDP2 only")
    rows, failed = [], {}
    for fw in frameworks:
        try:
            rows.append(summarize(fw, spawn(cuda_rank_main, cfg.world, fw, asdict(cfg)), cfg))
        except RuntimeError as e:  # FSDP2 must run; another framework's failure is reported, not fatal
            if fw == "torch_fsdp2":
                raise
            failed[fw] = str(e).strip().splitlines()[-1]
    print(f"\nCUDA, NCCL, world {cfg.world}, {'bf16 mixed precision' if cfg.bf16 else 'fp32'}")
    print_table(rows, "max_memory_allocated MiB")
    diffs = {r["framework"]: max_loss_diff(rows[0], r) for r in rows[1:]}
    print("max |loss - loss(torch_fsdp2)|: " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    for fw, err in failed.items():
        print(f"{fw} failed: {err}")
    return {"rows": rows, "max_loss_diff": diffs, "failed": failed}


# ---------------------------------------------------------------- main


def parse_args(argv: Optional[List[str]] = None) -> tuple:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (under a minute)")
    p.add_argument("--world", type=int, default=d.world)
    p.add_argument("--steps", type=int, default=None, help=f"timed steps (default {d.steps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps first (default {d.warmup})")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per rank per step")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / world)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision on both frameworks")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="fairscale_c's bucket_cap_mb (default 25)")
    p.add_argument(
        "--shared-rs-group",
        action="store_true",
        help="fairscale_c: process_group_reduce_scatter='default' (one group for all collectives)",
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CPU, then CUDA when available"
    )
    p.add_argument("--profile", metavar="FILE", help="cProfile rank 0 of fairscale_c's timed steps into FILE")
    p.add_argument("--out", default=RESULTS, help="JSON results path")
    a = p.parse_args(argv)
    cfg = quick_config() if a.quick else d
    for name in ("steps", "warmup", "layers", "d_model", "heads", "seq", "vocab", "batch"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    cfg.world, cfg.bf16 = a.world, a.bf16
    if a.bucket_cap_mb is not None:
        cfg.bucket_cap_mb = a.bucket_cap_mb
    cfg.shared_rs_group = a.shared_rs_group
    cfg.threads = a.threads if a.threads else max(1, (os.cpu_count() or 1) // cfg.world)
    if cfg.d_model % cfg.heads:
        p.error("--d-model must be a multiple of --heads")
    return a, cfg


def main(argv: Optional[List[str]] = None) -> int:
    args, cfg = parse_args(argv)
    print(f"config: {asdict(cfg)}; torch {torch.__version__}; {os.cpu_count()} CPU cores", flush=True)
    result: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "config": asdict(cfg),
        "params": n_params(cfg),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
    }
    if args.device in ("auto", "cpu"):
        result["cpu"] = run_cpu(cfg, args.profile)
    if args.device in ("auto", "cuda"):
        result["cuda"] = run_cuda(cfg)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
