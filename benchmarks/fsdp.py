"""FSDP benchmark: fairscale_c.nn.FullyShardedDataParallel vs PyTorch's FSDP2 on a GPT-style model.

CPU (always): `--world` ranks as spawned processes on gloo (fairscale_c on its shared-memory
engine). Every framework wraps every transformer block, then the root; same init, data, AdamW
settings and number of steps. Two methods, both printed:

* separate runs: one fresh set of processes per framework, one after the other, so none inflates
  another's memory high-water mark. Memory always comes from these.
* paired run (`run_cpu`, `rank_main_paired`; off with --no-paired): one more set of processes
  holds every framework's model and trains them in turn, one step each per round on the same
  batch, in orders balanced over positions and predecessors (`paired_orders`), with a gloo barrier
  before each framework's step. The ratios (step / the floor's step, own time / FSDP2's own time)
  are taken within each round and their medians decide the time targets; separate runs minutes
  apart see different machine loads (the floor moved ~36 ms between runs on the 2-core VM).

    PYTHONPATH=. python benchmarks/fsdp.py            # default model, fp32
    PYTHONPATH=. python benchmarks/fsdp.py --bf16     # bf16 mixed precision on both
    PYTHONPATH=. python benchmarks/fsdp.py --quick    # tiny model, a few steps (< 1 minute)
    PYTHONPATH=. python benchmarks/fsdp.py --world 4 --frameworks torch_fsdp2,fairscale_c,local

Reported per framework: median step time over the timed steps (a step is zero_grad + forward +
loss + backward + optimizer step + loss.item(); per step the slowest rank counts), tokens/s over
all ranks, and per rank the peak resident-set growth (see `_Mem`); for the paired run median and
quartiles of the per-round figures, own time per phase, minor page faults per step and the CPU
time of fairscale_c's progress threads (also during the other frameworks' steps, where it must
be ~0). The per-step losses of the frameworks are compared (fairscale_c's equal FSDP2's bit for
bit at world 2) as a guard against timing a broken run. FairScale 0.4.13's FSDP needs CUDA: on
CPU it is a "fails" row when installed.

CUDA (`--device cuda`, see `run_cuda`): NCCL, one spawned process set per framework (GPU memory
is freed between them), four rows: fairscale_c's FSDP, PyTorch's FSDP2 (`fully_shard` per block and
on the root), FairScale 0.4.13's FSDP when `fairscale` is importable, and the floor "local" (the
plain module on each rank's GPU, torch.autocast for --bf16, fp32 parameters, AdamW, no
communication). A framework that fails becomes a "fails: <reason>" row. With --bf16 every framework
keeps fp32 master parameters (shards) and computes in bf16; `--reduce-dtype` (fp32 by default on
CUDA) picks the gradient-reduction dtype of all three FSDPs. `--size 125m|350m|1.3b` picks a
GPT-2/GPT-3-like model at sequence 1024 and vocab 50304; the micro-batch is `--batch` (the lead
picks it; without it the largest batch whose rough memory estimate, `estimate_peak_gib`, fits in
75% of the GPU is used). Reported: median step, tokens/s, MFU (`model_flops_per_token`, against
`--peak-tflops`), peak torch.cuda.max_memory_allocated after the warm-up, each framework's time
above the floor, ratios and the world-1 targets. World > GPUs: ranks share GPUs
(NCCL_MULTI_RANK_GPU_ENABLE=1 is set for them; NCCL >= 2.30 needed), time-sliced.

    python benchmarks/fsdp.py --device cuda --size 125m --bf16 --batch 32 --steps 10 --warmup 3

Results go to stdout (a table) and benchmarks/results/fsdp.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import resource
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import check_cuda_ranks  # noqa: E402

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
    reduce_fp32: bool = False  # bf16: reduce gradients in fp32 (all FSDPs); default on CUDA
    size: str = ""  # the --size preset, if any


def quick_config() -> Config:
    """The small model of --quick (0.14M parameters), also the one benchmarks/test_bench_fsdp.py trains."""
    return Config(layers=2, d_model=64, heads=2, seq=64, vocab=512, batch=4, steps=5, warmup=2)


# --size presets: GPT-2 small / medium and GPT-3 XL shapes (GPT-3 XL's 2048 width with 16 heads of
# 128), sequence 1024, vocabulary 50304 (GPT-2's 50257 rounded up to a multiple of 64), output head
# tied to the embedding. Parameter counts: 124.5M, 354.9M, 1313.7M (n_params prints the exact one).
PRESETS: Dict[str, Dict[str, int]] = {
    "125m": {"layers": 12, "d_model": 768, "heads": 12, "seq": 1024, "vocab": 50304},
    "350m": {"layers": 24, "d_model": 1024, "heads": 16, "seq": 1024, "vocab": 50304},
    "1.3b": {"layers": 24, "d_model": 2048, "heads": 16, "seq": 1024, "vocab": 50304},
}
# Dense bf16 tensor-core peak of an H100 SXM5 (NVIDIA H100 datasheet: 1,979 TFLOP/s "with sparsity",
# half of it dense). --peak-tflops overrides it for another GPU.
H100_SXM_BF16_DENSE_TFLOPS = 989.4
FLOPS_FORMULA = (
    "6*N + 12*layers*seq*d_model per token (forward+backward; attention counted unmasked, PaLM's convention)"
)


def preset_config(size: str) -> Config:
    if size not in PRESETS:
        raise ValueError(f"size must be one of {sorted(PRESETS)}, got {size!r}")
    return Config(size=size, **PRESETS[size])


def model_flops_per_token(cfg: Config, params: int) -> float:
    """Training FLOPs per token: 6*N (forward 2N + backward 4N over every parameter; the tied
    embedding counts once, as the output head's matmul) plus attention's score and value matmuls,
    12*layers*seq*d_model (forward 4*seq*d_model per layer, backward twice that)."""
    return 6.0 * params + 12.0 * cfg.layers * cfg.seq * cfg.d_model


def mfu(cfg: Config, params: int, step_s: float, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation of one step over all ranks: model FLOPs of world*batch*seq tokens /
    (step time * peak of the `gpus` physical GPUs they ran on)."""
    if step_s <= 0 or gpus < 1 or peak_tflops <= 0:
        raise ValueError(f"mfu: step_s, gpus and peak_tflops must be > 0, got {step_s}, {gpus}, {peak_tflops}")
    tokens = cfg.world * cfg.batch * cfg.seq
    return model_flops_per_token(cfg, params) * tokens / (step_s * gpus * peak_tflops * 1e12)


def estimate_peak_gib(cfg: Config, framework: str, params: int) -> float:
    """A rough per-rank peak of GPU memory (GiB) for choosing --batch, not a measurement.
    Model state: fp32 parameters, gradients and AdamW's two moments (16 bytes per parameter, 1/world
    of it under FSDP), plus bf16 copies (FSDP: the gathered blocks; autocast: its weight cache;
    2 bytes per parameter, an over-estimate for FSDP). Activations per token: about 34*d_model bytes
    per block in bf16 (38 for autocast's fp32 residual stream; SDPA's fused kernels keep no
    seq x seq scores) plus ~12*vocab bytes at the loss (bf16 logits, their fp32 copy, log-softmax
    and its gradient), times 1.15 for allocator slack. fp32 runs: twice the activations, no copies."""
    per_param = 16.0 if framework == "local" else 16.0 / cfg.world
    lowp = 2.0 if cfg.bf16 else 0.0
    act = (38.0 if framework == "local" else 34.0) * cfg.d_model * cfg.layers + 12.0 * cfg.vocab
    if not cfg.bf16:
        act *= 2
    total = params * (per_param + lowp) + 1.15 * act * cfg.batch * cfg.seq
    return total / 2**30


def pick_batch(cfg: Config, params: int, budget_gib: float, frameworks: List[str]) -> int:
    """The largest batch from a fixed ladder whose estimate_peak_gib fits `budget_gib` for every framework."""
    best = 1
    for b in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
        trial = Config(**{**asdict(cfg), "batch": b})
        if max(estimate_peak_gib(trial, fw, params) for fw in frameworks) <= budget_gib:
            best = b
    return best


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


def _fairscale_mp_kwargs(cfg: Config) -> Dict[str, Any]:
    """FairScale-style mixed precision (fp32 shards, bf16 compute); the gradient is reduce-scattered
    in bf16 (FairScale's default) or, with cfg.reduce_fp32, in fp32 (fp32_reduce_scatter=True)."""
    if not cfg.bf16:
        return {}
    return {"mixed_precision": True, "compute_dtype": torch.bfloat16, "fp32_reduce_scatter": cfg.reduce_fp32}


def reduce_dtype_of(framework: str, cfg: Config) -> str:
    """The dtype each framework reduces gradients in under this config (for the report)."""
    if framework == "local":
        return "none (no communication)"
    if not cfg.bf16:
        return "fp32"
    return "fp32" if cfg.reduce_fp32 else "bf16"


def wrap_fairscale_c(model: GPT, cfg: Config) -> nn.Module:
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn.wrap import enable_wrap, wrap

    kwargs = _fairscale_mp_kwargs(cfg)
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

    kwargs = _fairscale_mp_kwargs(cfg)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        model.blocks = nn.ModuleList(wrap(b) for b in model.blocks)
    return FSDP(model, **kwargs)


def wrap_torch_fsdp2(model: GPT, cfg: Config) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The same reduce dtype as the FairScale-style wrappers (_fairscale_mp_kwargs), so all move
    # the same bytes: bf16 by default on CPU, fp32 by default on CUDA.
    reduce = torch.float32 if cfg.reduce_fp32 else torch.bfloat16
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce) if cfg.bf16 else None
    kwargs: Dict[str, Any] = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if next(model.parameters()).device.type == "cpu":
        # FSDP2's default mesh takes the CUDA device type whenever CUDA is available, so CPU ranks
        # of a CUDA build of torch would each claim a GPU (and fail with fewer GPUs than ranks)
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
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
    allocator keeps after a free still counts, as it does for any RSS figure.

    RSS counts a shared-memory page (the engine's segment, shared tensors) in every process that
    touched it, so ranks that read each other's shared buffers each count them. `end` also gives,
    at the end of the timed steps, the RSS above the baseline with those pages split: each shared
    page counted as 1/k in each of the k processes mapping it (PSS of shared memory), so the
    ranks' figures add up to the memory they use between them."""

    def __init__(self) -> None:
        self.base_kib = self.read()["VmRSS"]
        self.reset_ok = False

    @staticmethod
    def shmem_pss_kib() -> float:
        """This process's shared-memory pages (KiB), each divided by the number of processes mapping
        it; NaN where the kernel does not report it."""
        try:
            with open("/proc/self/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss_Shmem:"):
                        return float(line.split()[1])
        except OSError:
            pass
        return float("nan")

    def end(self, status: Dict[str, int]) -> Dict[str, float]:
        """RSS above the baseline, as counted and with shared-memory pages split (MiB); `status` is
        read() at the end."""
        rss = (status["VmRSS"] - self.base_kib) / 1024
        return {
            "end_rss_mib": rss,
            "end_split_mib": rss - (status.get("RssShmem", 0) - self.shmem_pss_kib()) / 1024,
        }

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


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: List[tuple], sync, autocast=None) -> tuple:
    """Train on `batches`; per step its wall time (ended by `sync`) and loss. `autocast`: a
    context-manager factory around forward and loss (the CUDA floor's torch.autocast)."""
    times, losses = [], []
    for x, y in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if autocast is None:
            loss = model(x, y)
        else:
            with autocast():
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
    flt0, eng0 = _minor_faults(), _engine_cpu_ns()
    t, lo = _train(model, opt, batches[cfg.warmup :], lambda: None)
    flt1, eng1 = _minor_faults(), _engine_cpu_ns()
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
        **mem.end(end),
        "hwm_reset": mem.reset_ok,
        "minflt_per_step": (flt1 - flt0) / max(1, cfg.steps),
        "engine_cpu_ms_per_step": (eng1 - eng0) / 1e6 / max(1, cfg.steps),
    }


def _minor_faults() -> int:
    """Minor page faults of this process so far (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _engine_cpu_ns() -> int:
    """On-CPU nanoseconds so far of this process's fairscale_c progress threads (named
    "fsc_progress"), from /proc/self/task/*/schedstat; 0 where there are none or it is unreadable."""
    total = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "fsc_progress":
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


# glibc settings for the paired run's processes: blocks under 32 MiB come from the heap and the heap
# is never trimmed. Several frameworks in one process share one heap, and what one framework frees
# at the top of it decides whether the next one's allocations fault pages in again; run alone,
# each framework keeps its own steady state. The separate runs keep glibc's defaults (what a user
# gets), and both methods print the faults per step, so the difference is visible.
PAIRED_MALLOC = {
    "kept": "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296",
    "default": "",
}


@contextlib.contextmanager
def malloc_env(setting: str) -> Iterator[None]:
    """While spawning, add the glibc tunables of PAIRED_MALLOC[setting] to the environment the
    ranks inherit (after any the caller set, so the caller's own settings of other tunables stay)."""
    extra = PAIRED_MALLOC[setting]
    old = os.environ.get("GLIBC_TUNABLES")
    if extra:
        os.environ["GLIBC_TUNABLES"] = f"{old}:{extra}" if old else extra
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = old


def paired_orders(n: int) -> List[List[int]]:
    """Orders for the paired run's rounds (a Williams design): over len(result) consecutive rounds
    every framework takes every position equally often and directly follows every other framework
    equally often, so whatever one step leaves behind (freed memory, caches, a busy core) falls on
    each framework alike. n rows for even n, 2n (the rows and their reverses) for odd n; for n <= 3
    these are all orders."""
    if n < 1:
        raise ValueError(f"paired_orders: n must be >= 1, got {n}")
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo if len(first) % 2 else hi)
        lo, hi = (lo + 1, hi) if len(first) % 2 == 0 else (lo, hi - 1)
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows + [r[::-1] for r in rows] if n % 2 and n > 1 else rows


def _phased_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """`_train`'s step, timed in phases: (step seconds, (zero_grad + forward, backward, optimizer
    step, loss.item()) seconds, loss, minor page faults per phase)."""
    f0 = _minor_faults()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    t1 = time.perf_counter()
    f1 = _minor_faults()
    loss.backward()
    t2 = time.perf_counter()
    f2 = _minor_faults()
    opt.step()
    t3 = time.perf_counter()
    f3 = _minor_faults()
    lv = loss.item()
    t4 = time.perf_counter()
    return t4 - t0, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), lv, (f1 - f0, f2 - f1, f3 - f2)


def rank_main_paired(rank: int, world: int, frameworks: List[str], cfg_dict: Dict[str, Any]) -> Dict:
    """One rank of the paired CPU run (timing only): every framework's model and AdamW in this one
    process, trained in turn, one step each per round, in the orders of `paired_orders`, so that
    load from elsewhere on the machine falls on all of them within seconds of each other rather
    than on separate runs minutes apart. Before each framework's step the ranks meet at a gloo
    barrier (outside the timing), so no framework's step absorbs the previous one's rank skew.
    Per framework and step: time, phases, loss, this process's minor page faults and CPU time
    (all threads, and the training thread alone), and the CPU time of fairscale_c's progress
    threads (which must be asleep during the other frameworks' steps: they wait on a condition
    variable whenever their queue is empty)."""
    cfg = Config(**cfg_dict)
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    batches = make_batches(cfg, rank, torch.device("cpu"))
    for fw in frameworks:
        _load_libraries(fw)
    built = {}
    for fw in frameworks:
        torch.manual_seed(cfg.seed)
        model = WRAPPERS[fw](GPT(cfg), cfg)
        built[fw] = (model, torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    keys = ("times", "phases", "losses", "minflt", "minflt_by_phase", "engine_ms", "cpu_ms", "main_cpu_ms")
    out = {fw: {k: [] for k in keys} for fw in frameworks}
    orders = paired_orders(len(frameworks))
    for i, (x, y) in enumerate(batches):
        for k in orders[i % len(orders)]:
            fw = frameworks[k]
            dist.barrier()
            flt0, eng0, cpu0, main0 = _minor_faults(), _engine_cpu_ns(), time.process_time(), time.thread_time()
            t, ph, lv, ph_flt = _phased_step(*built[fw], x, y)
            cpu1, main1, flt1, eng1 = time.process_time(), time.thread_time(), _minor_faults(), _engine_cpu_ns()
            rec = out[fw]
            rec["minflt_by_phase"].append(ph_flt)
            rec["cpu_ms"].append((cpu1 - cpu0) * 1e3)
            rec["main_cpu_ms"].append((main1 - main0) * 1e3)
            rec["times"].append(t)
            rec["phases"].append(ph)
            rec["losses"].append(lv)
            rec["minflt"].append(flt1 - flt0)
            rec["engine_ms"].append((eng1 - eng0) / 1e6)
    dist.barrier()
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------- spawning


def _entry(fn, rank: int, world: int, port: int, q: Any, args: tuple) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),  # as torchrun sets it: one host
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
    row = {
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
    for key in ("minflt_per_step", "engine_cpu_ms_per_step", "end_rss_mib", "end_split_mib"):  # CPU rank_main only
        if all(key in r for r in ranks):
            row[key] = [r[key] for r in ranks]
    return row


def max_loss_diff(a: Dict, b: Dict) -> float:
    diffs = [abs(x - y) for la, lb in zip(a["losses"], b["losses"]) for x, y in zip(la, lb)]
    diffs = [d for d in diffs if not math.isnan(d)]
    return max(diffs) if diffs else float("nan")


def spread(values: List[float]) -> Dict[str, float]:
    """Median, quartiles, extremes and count of `values` (NaN for none)."""
    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        nan = float("nan")
        return {"median": nan, "q1": nan, "q3": nan, "min": nan, "max": nan, "n": 0}
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0], v[0], v[0])
    return {"median": statistics.median(v), "q1": q1, "q3": q3, "min": v[0], "max": v[-1], "n": len(v)}


PHASES = ("fwd", "bwd", "opt", "item")  # zero_grad + forward, backward, optimizer step, loss.item()


def paired_summary(ranks: List[Dict[str, Dict]], cfg: Config) -> Dict[str, Dict[str, Any]]:
    """The paired run's figures per framework, each computed within a round (the frameworks' steps
    on the same batch, seconds apart) and then summarised over the timed rounds with `spread`:
    the step (slowest rank), its ratio to the floor's step of the same round, its own time (step
    minus that floor step), fairscale_c's own time over FSDP2's of the same round, and the own time
    per phase (the slowest rank's phases minus the floor's slowest rank's). Also the losses (as
    summarize has them), minor page faults per step and the progress threads' CPU time."""
    timed = range(cfg.warmup, cfg.warmup + cfg.steps)
    fws = list(ranks[0])
    if "local" not in fws:
        raise ValueError("paired_summary: the local row (the floor) is required")
    slowest = {fw: [max(range(len(ranks)), key=lambda r: ranks[r][fw]["times"][i]) for i in timed] for fw in fws}
    step = {fw: [ranks[r][fw]["times"][i] for r, i in zip(slowest[fw], timed)] for fw in fws}
    phases = {fw: [ranks[r][fw]["phases"][i] for r, i in zip(slowest[fw], timed)] for fw in fws}
    floor = step["local"]
    own = {fw: [(a - b) * 1e3 for a, b in zip(step[fw], floor)] for fw in fws}
    out: Dict[str, Dict[str, Any]] = {}
    for fw in fws:
        row: Dict[str, Any] = {
            "step_ms": spread([t * 1e3 for t in step[fw]]),
            "step_ms_each": [t * 1e3 for t in step[fw]],
            "ratio_to_floor": spread([a / b for a, b in zip(step[fw], floor)]),
            "own_ms": spread(own[fw]),
            "own_ms_by_phase": {
                name: statistics.median((p[k] - q[k]) * 1e3 for p, q in zip(phases[fw], phases["local"]))
                for k, name in enumerate(PHASES)
            },
            "phase_ms": {name: statistics.median(p[k] * 1e3 for p in phases[fw]) for k, name in enumerate(PHASES)},
            "losses": [r[fw]["losses"] for r in ranks],
            "minflt_per_step": spread([statistics.mean(r[fw]["minflt"][i] for r in ranks) for i in timed]),
            "minflt_by_phase": {
                name: statistics.median(statistics.mean(r[fw]["minflt_by_phase"][i][k] for r in ranks) for i in timed)
                for k, name in enumerate(PHASES[:3])
            },
            "engine_cpu_ms_per_step": spread([max(r[fw]["engine_ms"][i] for r in ranks) for i in timed]),
            "cpu_ms_per_step": spread([statistics.mean(r[fw]["cpu_ms"][i] for r in ranks) for i in timed]),
            "main_cpu_ms_per_step": spread([statistics.mean(r[fw]["main_cpu_ms"][i] for r in ranks) for i in timed]),
            # all steps, warm-up included, all ranks: the progress threads' CPU time while this
            # framework stepped (for every framework but fairscale_c it must be 0)
            "engine_cpu_ms_total": sum(sum(r[fw]["engine_ms"]) for r in ranks),
        }
        if BASELINE in fws and fw not in (BASELINE, "local"):
            ratios = [o / b if b > 0 else float("nan") for o, b in zip(own[fw], own[BASELINE])]
            row["own_vs_fsdp2"] = spread(ratios)
            row["own_vs_fsdp2_dropped"] = sum(math.isnan(r) for r in ratios)  # rounds where FSDP2's own <= 0
        out[fw] = row
    return out


def _med(row: Dict, key: str) -> float:
    """The median of a paired spread in `row`."""
    return row["paired"][key]["median"]


def _first(row: Dict, key: str) -> float:
    """Rank 0's value of a per-rank list in `row`, NaN without it."""
    return row[key][0] if row.get(key) else float("nan")


def _sp(s: Dict[str, float], spec: str) -> str:
    """'median [q1–q3]' of a spread."""
    return f"{_fmt(s['median'], spec)} [{_fmt(s['q1'], spec)}-{_fmt(s['q3'], spec)}]"


def memory_end_line(rows: List[Dict]) -> Optional[str]:
    """The rows' memory at the end of their separate runs' timed steps, above the baseline per
    rank, as RSS counts it and with shared-memory pages split among the ranks mapping them (see
    _Mem). None when no row has them (CUDA runs)."""
    cells = [
        f"{r['framework']} " + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(r["end_rss_mib"], r["end_split_mib"]))
        for r in rows
        if "end_rss_mib" in r and "end_split_mib" in r
    ]
    if not cells:
        return None
    return (
        "memory at the end of the timed steps (separate runs), MiB above the baseline per rank, RSS/with shared "
        "pages split: " + "; ".join(cells)
    )


def print_table(rows: List[Dict], mem_label: str) -> None:
    """Separate runs only (the layout before the paired run existed; --no-paired prints it)."""
    base = next((r for r in rows if r["framework"] == BASELINE), None)
    mem_head = mem_label + " per rank"
    head = f"{'framework':<14}{'step ms':>10}{'tokens/s':>11}  {mem_head:<24}{'step/FSDP2':>11}{'mem/FSDP2':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['framework']:<14}fails: {r['error']}")
            continue
        mem = " / ".join(f"{m:.0f}" for m in r["peak_mib"])
        sr = r["step_ms"] / base["step_ms"] if base else float("nan")
        mr = max(r["peak_mib"]) / max(base["peak_mib"]) if base else float("nan")
        r["step_ratio_vs_fsdp2"], r["mem_ratio_vs_fsdp2"] = sr, mr
        print(f"{r['framework']:<14}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11.0f}  {mem:<24}{sr:>11.2f}{mr:>11.2f}")


def print_paired_table(rows: List[Dict], cfg: Config) -> None:
    """Both methods side by side: the separate runs' median step and memory, and the paired run's
    per-round figures as median [quartiles] over the timed rounds."""
    base = next((r for r in rows if r["framework"] == BASELINE and "error" not in r), None)
    head = (
        f"{'framework':<13}{'sep. ms':>9}{'paired ms':>11}  {'step/floor [IQR]':<22}{'own ms [IQR]':<21}"
        f"{'own/FSDP2 own [IQR]':<21}{'tok/s':>7}  {'peak MiB/rank (sep.)':<21}{'mem/FSDP2':>9}{'dloss FSDP2':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['framework']:<13}fails: {r['error']}")
            continue
        p = r.get("paired")
        mem = " / ".join(f"{m:.0f}" for m in r["peak_mib"])
        r["mem_ratio_vs_fsdp2"] = max(r["peak_mib"]) / max(base["peak_mib"]) if base else float("nan")
        r["step_ratio_vs_fsdp2"] = r["step_ms"] / base["step_ms"] if base else float("nan")
        dl = max_loss_diff(p, base["paired"]) if p and base and r is not base and base.get("paired") else float("nan")
        if p is None:
            cells = f"{'-':>11}  {'(not in the paired run)':<64}{'':<21}{'':>7}"
        else:
            own = "-" if r["framework"] == "local" else _sp(p["own_ms"], ".1f")
            ov = _sp(p["own_vs_fsdp2"], ".3f") if "own_vs_fsdp2" in p else "-"
            tok = cfg.world * cfg.batch * cfg.seq / (p["step_ms"]["median"] / 1e3)
            ratio = _sp(p["ratio_to_floor"], ".3f")
            cells = f"{p['step_ms']['median']:>11.1f}  {ratio:<22}{own:<21}{ov:<21}{tok:>7.0f}"
        print(
            f"{r['framework']:<13}{r['step_ms']:>9.1f}{cells}  {mem:<21}{r['mem_ratio_vs_fsdp2']:>9.2f}"
            f"{_fmt(dl, '.3g'):>12}"
        )


def run_cpu(
    cfg: Config,
    profile: Optional[str],
    frameworks: Optional[List[str]] = None,
    paired: bool = True,
    paired_malloc: str = "kept",
) -> Dict[str, Any]:
    """Separate runs (one fresh process set per framework: memory, and times as before), then with
    `paired` one more process set training every framework that ran in turn (rank_main_paired),
    whose per-round figures decide the time targets; its processes get the glibc settings
    PAIRED_MALLOC[paired_malloc]. fairscale (0.4.13) is optional: skipped when not importable, a
    "fails" row when it fails (its FSDP needs CUDA)."""
    frameworks = list(frameworks or CPU_FRAMEWORKS)
    if "local" not in frameworks:
        frameworks.append("local")
    rows: List[Dict[str, Any]] = []
    skipped: Dict[str, str] = {}
    for fw in frameworks:
        if fw == "fairscale" and importlib.util.find_spec("fairscale") is None:
            skipped[fw] = "fairscale is not installed (pip install fairscale==0.4.13)"
            print(f"[cpu] {fw}: skipped, {skipped[fw]}", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            ranks = spawn(rank_main, cfg.world, fw, asdict(cfg), profile if fw == "fairscale_c" else None)
        except RuntimeError as e:
            if fw != "fairscale":
                raise
            rows.append({"framework": fw, "error": _failure_reason(e)})
            print(f"[cpu] {fw}: fails: {rows[-1]['error']}", flush=True)
            continue
        rows.append(summarize(fw, ranks, cfg))
        print(f"[cpu] {fw}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    by = {r["framework"]: r for r in rows if "error" not in r}
    if paired:
        fws = [r["framework"] for r in rows if "error" not in r]
        t0 = time.perf_counter()
        with malloc_env(paired_malloc):
            ranks = spawn(rank_main_paired, cfg.world, fws, asdict(cfg))
        print(f"[cpu] paired run ({', '.join(fws)} in turn): done in {time.perf_counter() - t0:.1f} s", flush=True)
        for fw, summary in paired_summary(ranks, cfg).items():
            by[fw]["paired"] = summary
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(
        f"\nCPU, gloo (fairscale_c on its shared-memory engine), world {cfg.world}, "
        f"{'bf16 mixed precision' if cfg.bf16 else 'fp32'}, {cfg.threads} thread(s) per rank, "
        f"{n_params(cfg) / 1e6:.2f}M params, {cfg.steps} timed steps after {cfg.warmup} warm-up; load {load:.2f}; "
        + (
            "separate runs (one process set per framework, glibc malloc defaults) and a paired run (every "
            "framework in one process set, one step each per round, orders balanced; malloc "
            + (f"GLIBC_TUNABLES {PAIRED_MALLOC[paired_malloc]}" if PAIRED_MALLOC[paired_malloc] else "defaults")
            + "); floor = local"
            if paired
            else "separate runs (one process set per framework)"
        )
    )
    if paired:
        print_paired_table(rows, cfg)
        print(
            "sep. ms: median step of the separate run; paired: per round (same batch, seconds apart), median "
            "[quartiles] over the timed rounds; own = step - the floor's step of the same round; "
            "dloss = max |loss - FSDP2's| over steps and ranks (paired run); peak memory from the separate runs"
        )
    else:
        print_table(rows, "peak RSS growth MiB")
    line = memory_end_line([r for r in rows if "error" not in r])
    if line:
        print(line)
    for fw, why in skipped.items():
        print(f"{fw}: skipped ({why})")
    result = _cpu_verdicts(by, cfg, paired)
    result.update(rows=rows, skipped=skipped, method="paired" if paired else "separate", load_at_end=load)
    if paired:
        result["paired_malloc"] = {"setting": paired_malloc, "glibc_tunables": PAIRED_MALLOC[paired_malloc]}
    if not all(r["hwm_reset"] for r in by.values()):
        print("note: /proc/self/clear_refs was not writable; peaks include model construction")
    return result


def _cpu_verdicts(by: Dict[str, Dict], cfg: Config, paired: bool) -> Dict[str, Any]:
    """The target lines (decided on the paired medians when there is a paired run, else on the
    separate runs) and the diagnostics under the table."""
    fc, f2, local = by.get("fairscale_c"), by.get(BASELINE), by["local"]
    out: Dict[str, Any] = {}
    if fc is None or f2 is None:
        print("targets: not judged (fairscale_c or torch_fsdp2 row missing)")
        return out
    diff = max_loss_diff(fc, f2)
    out["max_loss_diff"] = diff
    print(f"max |loss(fairscale_c) - loss(torch_fsdp2)| over steps and ranks, separate runs: {diff:.3g}", end="")
    if paired:
        out["paired_max_loss_diff"] = max_loss_diff(fc["paired"], f2["paired"])
        same = {fw: r["paired"]["losses"] == r["losses"] for fw, r in by.items()}
        out["paired_losses_equal_separate"] = same
        print(
            f"; paired run: {out['paired_max_loss_diff']:.3g}; paired losses equal the separate runs': "
            + ", ".join(f"{fw} {'yes' if ok else 'NO'}" for fw, ok in same.items())
        )
    else:
        print()
    own_sep, own_f2_sep = fc["step_ms"] - local["step_ms"], f2["step_ms"] - local["step_ms"]
    over_sep = fc["step_ms"] / local["step_ms"]
    mem = max(fc["peak_mib"]) / max(f2["peak_mib"])
    out.update(
        separate_step_vs_floor=over_sep,
        separate_own_ms=own_sep,
        separate_fsdp2_own_ms=own_f2_sep,
        separate_target_step_met=over_sep <= TARGET_STEP_OVER_FLOOR,
        separate_target_own_time_met=own_f2_sep > 0 and own_sep <= TARGET_OWN_VS_FSDP2 * own_f2_sep,
        compute_floor_vs_fsdp2=local["step_ms"] / f2["step_ms"],
        target_mem_met=mem <= TARGET_MEM_RATIO,
        mem_vs_fsdp2=mem,
    )
    sep_step = f"separate runs: {over_sep:.3f}x"
    sep_own = f"separate runs: own {own_sep:.1f} vs FSDP2's {own_f2_sep:.1f} ms" + (
        f" = {own_sep / own_f2_sep:.3f}x" if own_f2_sep > 0 else ""
    )
    if paired:
        p, p2 = fc["paired"], f2["paired"]
        over, ratio = p["ratio_to_floor"], p["own_vs_fsdp2"]
        out.update(
            step_vs_floor=over["median"],
            own_vs_fsdp2=ratio["median"],
            own_ms=p["own_ms"]["median"],
            fsdp2_own_ms=p2["own_ms"]["median"],
            target_step_met=over["median"] <= TARGET_STEP_OVER_FLOOR,
            target_own_time_met=ratio["n"] > 0 and ratio["median"] <= TARGET_OWN_VS_FSDP2,
        )
        dropped = p["own_vs_fsdp2_dropped"]
        print(
            f"target step <= {TARGET_STEP_OVER_FLOOR}x the floor: {'met' if out['target_step_met'] else 'NOT met'} "
            f"(paired: median per-round ratio {_sp(over, '.3f')} over {over['n']} rounds; {sep_step})"
        )
        print(
            f"target own time <= {TARGET_OWN_VS_FSDP2}x FSDP2's: {'met' if out['target_own_time_met'] else 'NOT met'} "
            f"(paired: median per-round ratio {_sp(ratio, '.3f')}"
            + (f", {dropped} round(s) with FSDP2's own <= 0 left out" if dropped else "")
            + f"; median own ms {p['own_ms']['median']:.1f} vs FSDP2's {p2['own_ms']['median']:.1f}; {sep_own})"
        )
    else:
        out.update(
            step_vs_floor=over_sep,
            target_step_met=out["separate_target_step_met"],
            target_own_time_met=out["separate_target_own_time_met"],
        )
        print(
            f"target step <= {TARGET_STEP_OVER_FLOOR}x the floor: {'met' if out['target_step_met'] else 'NOT met'} "
            f"({sep_step}); own time <= {TARGET_OWN_VS_FSDP2}x FSDP2's: "
            f"{'met' if out['target_own_time_met'] else 'NOT met'} ({sep_own})"
        )
    print(
        f"target peak memory <= FSDP2's (separate runs): {'met' if out['target_mem_met'] else 'NOT met'} ({mem:.2f}x)"
    )
    if paired:
        for fw in (r for r in ("fairscale_c", BASELINE, "fairscale") if r in by):
            ph = by[fw]["paired"]["own_ms_by_phase"]
            print(
                f"own time by phase, {fw} (paired, median of per-round differences from local, ms): "
                + ", ".join(f"{k} {v:+.1f}" for k, v in ph.items())
            )
        lp = local["paired"]["phase_ms"]
        adj = lp["opt"] * (1 - 1 / cfg.world)
        print(
            "local's phases (ms): "
            + ", ".join(f"{k} {v:.1f}" for k, v in lp.items())
            + f"; its AdamW steps every parameter, FSDP's 1/{cfg.world} of them: about {adj:.1f} ms of each "
            "FSDP's own time is hidden by that"
        )
        eng = p["engine_cpu_ms_per_step"]
        others = {fw: r["paired"]["engine_cpu_ms_total"] for fw, r in by.items() if fw != "fairscale_c"}
        out["engine_cpu_ms_during_others"] = others
        out["engine_cpu_ms_per_step"] = eng["median"]
        print(
            f"fairscale_c's progress threads: {eng['median']:.1f} ms CPU per step of its own (paired, slowest rank), "
            f"{_first(fc, 'engine_cpu_ms_per_step'):.1f} ms in the separate run (rank 0); during the "
            "other frameworks' steps, all ranks, all steps: "
            + ", ".join(f"{fw} {v:.3f} ms" for fw, v in others.items())
        )
        print(
            "CPU ms per step and rank, paired (median of the rank mean), all threads / training thread: "
            + ", ".join(
                f"{fw} {r['paired']['cpu_ms_per_step']['median']:.1f} / {_med(r, 'main_cpu_ms_per_step'):.1f}"
                for fw, r in by.items()
            )
            + f" (wall: the step; {cfg.world} ranks on {os.cpu_count()} cores)"
        )
        print(
            "minor page faults per step, paired (median of the rank mean) / separate (rank 0): "
            + ", ".join(
                f"{fw} {r['paired']['minflt_per_step']['median']:.0f} / {_first(r, 'minflt_per_step'):.0f}"
                for fw, r in by.items()
            )
            + "; paired by phase: "
            + "; ".join(
                f"{fw} " + " ".join(f"{k} {v:.0f}" for k, v in r["paired"]["minflt_by_phase"].items())
                for fw, r in by.items()
            )
        )
    return out


# ---------------------------------------------------------------- CUDA (NCCL)


CUDA_FRAMEWORKS = ["torch_fsdp2", "fairscale_c", "fairscale", "local"]  # FSDP2 first: the baseline
CPU_FRAMEWORKS = CUDA_FRAMEWORKS
CUDA_TIMEOUT_S = 600.0  # per framework; a hung NCCL run becomes a "fails" row
# World-1 targets on CUDA (issue 17): step <= 1.03x the floor and <= 0.9x FSDP2's, tokens/s >= 1.2x
# FairScale's, peak memory <= FSDP2's.
CUDA_TARGET_STEP_OVER_FLOOR = 1.03
CUDA_TARGET_STEP_VS_FSDP2 = 0.9
CUDA_TARGET_TOKENS_VS_FAIRSCALE = 1.2
CUDA_TARGET_MEM_VS_FSDP2 = 1.0


def _nccl_version_string() -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:
        return f"unknown ({type(e).__name__})"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _cuda_env() -> Dict[str, Any]:
    """What this rank runs on: GPU, driver, CUDA, torch's NCCL and the one fairscale_c loads."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    env: Dict[str, Any] = {
        "device_name": props.name,
        "device_total_mib": props.total_memory / 2**20,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "device_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_nccl": _nccl_version_string(),
        "nccl_multi_rank_gpu_enable": os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE"),
    }
    try:
        from fairscale_c.__main__ import collect

        # what `python -m fairscale_c` reports: build_info() after loading NCCL as the backend
        # would, so the version is known even for a framework (or world 1) that opened no
        # communicator of ours
        info = collect()
        for key in ("version", "kernels_built", "driver_version", "runtime_version", "nccl_version", "nccl_path"):
            env[f"fairscale_c_{key}"] = info.get(key)
    except Exception as e:  # report, do not fail the run over it
        env["fairscale_c_error"] = f"{type(e).__name__}: {e}"
    try:
        import fairscale

        env["fairscale"] = fairscale.__version__
    except Exception:
        env["fairscale"] = None
    return env


def cuda_rank_main(rank: int, world: int, framework: str, cfg_dict: Dict[str, Any]) -> Dict:
    """One rank of a CUDA (NCCL) run. The model is built on the rank's GPU from the same seed for
    every framework; "local" is the plain module (torch.autocast for bf16, fp32 parameters). Peak
    memory is torch.cuda.max_memory_allocated over the timed steps (reset after the warm-up)."""
    import datetime as dt
    import gc

    cfg = Config(**cfg_dict)
    dev = torch.device("cuda", rank % torch.cuda.device_count())  # ranks share a GPU when world > GPUs
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=dt.timedelta(seconds=CUDA_TIMEOUT_S / 2))
    batches = make_batches(cfg, rank, dev)
    torch.manual_seed(cfg.seed)
    with torch.device(dev):
        model: nn.Module = GPT(cfg)
    autocast = None
    if framework == "local":
        if cfg.bf16:
            autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    else:
        model = WRAPPERS[framework](model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    torch.cuda.synchronize()
    after_wrap = torch.cuda.memory_allocated() / 2**20
    times, losses = _train(model, opt, batches[: cfg.warmup], torch.cuda.synchronize, autocast)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t, lo = _train(model, opt, batches[cfg.warmup :], torch.cuda.synchronize, autocast)
    times, losses = times + t, losses + lo
    peak = torch.cuda.max_memory_allocated() / 2**20
    reserved = torch.cuda.max_memory_reserved() / 2**20
    env = _cuda_env() if rank == 0 else {}
    with contextlib.suppress(Exception):
        dist.barrier()
    del model, opt, batches
    gc.collect()
    torch.cuda.empty_cache()
    dist.destroy_process_group()
    return {
        "times": times,
        "losses": losses,
        "peak_mib": peak,
        "reserved_mib": reserved,
        "after_wrap_mib": after_wrap,
        "shmem_mib": 0.0,
        "hwm_reset": True,
        "device": str(dev),
        "env": env,
    }


def _failure_reason(err: BaseException) -> str:
    """The last informative line of a rank's traceback (the exception itself)."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith(("File ", "^", "~")):
            return ln[:300]
    return type(err).__name__


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) and not math.isnan(a) else float("nan")


def cuda_report(rows: List[Dict], cfg: Config, params: int, gpus: int, peak_tflops: float) -> Dict[str, Any]:
    """Fill every row's derived figures (MFU, ratios, own time, loss differences) and decide the
    targets for fairscale_c. Rows of failed frameworks carry "error" and are left as they are."""
    by = {r["framework"]: r for r in rows if "error" not in r}
    floor, fsdp2, fs = by.get("local"), by.get("torch_fsdp2"), by.get("fairscale")
    for r in by.values():
        r["tokens_per_s_per_rank"] = r["tokens_per_s"] / cfg.world
        r["mfu"] = mfu(cfg, params, r["step_ms"] / 1e3, gpus, peak_tflops)
        r["peak_mib_max"] = max(r["peak_mib"])
        r["own_ms_above_floor"] = r["step_ms"] - floor["step_ms"] if floor else float("nan")
        r["step_vs_floor"] = _ratio(r["step_ms"], floor["step_ms"]) if floor else float("nan")
        r["step_vs_fsdp2"] = _ratio(r["step_ms"], fsdp2["step_ms"]) if fsdp2 else float("nan")
        r["mem_vs_fsdp2"] = _ratio(r["peak_mib_max"], fsdp2["peak_mib_max"] if fsdp2 else float("nan"))
        r["tokens_vs_fairscale"] = _ratio(r["tokens_per_s"], fs["tokens_per_s"]) if fs else float("nan")
        r["max_loss_diff_vs_fsdp2"] = max_loss_diff(r, fsdp2) if fsdp2 and r is not fsdp2 else float("nan")
        r["max_loss_diff_vs_floor"] = max_loss_diff(r, floor) if floor and r is not floor else float("nan")
    targets: Dict[str, Any] = {}
    ours = by.get("fairscale_c")

    def decide(name: str, value: float, limit: float, ok) -> None:
        met = None if math.isnan(value) else bool(ok(value, limit))
        targets[name] = {"value": value, "limit": limit, "met": met}

    if ours is not None:
        decide("step_vs_floor", ours["step_vs_floor"], CUDA_TARGET_STEP_OVER_FLOOR, lambda v, lim: v <= lim)
        decide("step_vs_fsdp2", ours["step_vs_fsdp2"], CUDA_TARGET_STEP_VS_FSDP2, lambda v, lim: v <= lim)
        decide(
            "tokens_vs_fairscale",
            ours["tokens_vs_fairscale"],
            CUDA_TARGET_TOKENS_VS_FAIRSCALE,
            lambda v, lim: v >= lim,
        )
        decide("mem_vs_fsdp2", ours["mem_vs_fsdp2"], CUDA_TARGET_MEM_VS_FSDP2, lambda v, lim: v <= lim)
    return targets


def _fmt(v: float, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_cuda_table(rows: List[Dict], cfg: Config, targets: Dict[str, Any], gpus: int, peak_tflops: float) -> None:
    head = (
        f"{'framework':<12}{'step ms':>9}{'tok/s total':>12}{'tok/s rank':>11}{'MFU':>7}{'peak MiB':>10}"
        f"{'own ms':>8}{'/floor':>8}{'/FSDP2':>8}{'mem/FSDP2':>10}{'tok/FS':>8}{'dloss FSDP2':>12}"
        f"{'dloss floor':>12}  reduce"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['framework']:<12}fails: {r['error']}")
            continue
        print(
            f"{r['framework']:<12}{r['step_ms']:>9.1f}{r['tokens_per_s']:>12.0f}{r['tokens_per_s_per_rank']:>11.0f}"
            f"{r['mfu'] * 100:>6.1f}%{r['peak_mib_max']:>10.0f}{r['own_ms_above_floor']:>8.1f}"
            f"{_fmt(r['step_vs_floor'], '.3f'):>8}{_fmt(r['step_vs_fsdp2'], '.3f'):>8}"
            f"{_fmt(r['mem_vs_fsdp2'], '.3f'):>10}{_fmt(r['tokens_vs_fairscale'], '.2f'):>8}"
            f"{_fmt(r['max_loss_diff_vs_fsdp2'], '.3g'):>12}{_fmt(r['max_loss_diff_vs_floor'], '.3g'):>12}"
            f"  {r['reduce_dtype']}"
        )
    print(
        f"MFU = model FLOPs / (step time x {gpus} GPU(s) x {peak_tflops:g} TFLOP/s); model FLOPs = {FLOPS_FORMULA}; "
        f"peak: {'--peak-tflops' if peak_tflops != H100_SXM_BF16_DENSE_TFLOPS else 'H100 SXM dense bf16 (datasheet)'}"
    )
    print("own ms = step - floor step; dloss = max |loss difference| over steps and ranks; peak MiB = max over ranks")
    if cfg.world > 1:
        print("(at world > 1 the floor trains each rank on its own batch alone, so its losses differ by design)")
    if cfg.world > 1:
        print("(world 1 targets below are shown for reference only at this world size)")
    names = {
        "step_vs_floor": f"step <= {CUDA_TARGET_STEP_OVER_FLOOR}x the floor",
        "step_vs_fsdp2": f"step <= {CUDA_TARGET_STEP_VS_FSDP2}x FSDP2's",
        "tokens_vs_fairscale": f"tokens/s >= {CUDA_TARGET_TOKENS_VS_FAIRSCALE}x FairScale's",
        "mem_vs_fsdp2": f"peak memory <= {CUDA_TARGET_MEM_VS_FSDP2}x FSDP2's",
    }
    if not targets:
        print("targets: n/a (fairscale_c failed)")
    for key, t in targets.items():
        verdict = {True: "met", False: "NOT met", None: "n/a (baseline failed or absent)"}[t["met"]]
        print(f"target, fairscale_c {names[key]}: {verdict} ({_fmt(t['value'], '.3f')})")


def run_cuda(
    cfg: Config, frameworks: Optional[List[str]] = None, peak_tflops: float = H100_SXM_BF16_DENSE_TFLOPS
) -> Dict[str, Any]:
    """Every framework in its own spawned process set; a failure becomes a row with "error"."""
    # exits with a message when the ranks cannot have a GPU each or share one; when they share,
    # sets NCCL_MULTI_RANK_GPU_ENABLE=1, which the spawned ranks inherit
    print(f"[cuda] {check_cuda_ranks(cfg.world)}", flush=True)
    n_dev = torch.cuda.device_count()
    gpus = min(cfg.world, n_dev)
    params = n_params(cfg)
    frameworks = list(frameworks or CUDA_FRAMEWORKS)
    rows: List[Dict[str, Any]] = []
    env: Dict[str, Any] = {}
    for fw in frameworks:
        t0 = time.perf_counter()
        est = estimate_peak_gib(cfg, fw, params)
        try:
            if fw == "fairscale" and importlib.util.find_spec("fairscale") is None:
                raise RuntimeError("fairscale is not installed (pip install fairscale==0.4.13)")
            ranks = spawn(cuda_rank_main, cfg.world, fw, asdict(cfg), timeout=CUDA_TIMEOUT_S)
            row = summarize(fw, ranks, cfg)
            row["reserved_mib"] = [r["reserved_mib"] for r in ranks]
            row["devices"] = [r["device"] for r in ranks]
            env = env or ranks[0]["env"]
            status = f"{statistics.median(row['step_ms_each']):.1f} ms/step"
        except BaseException as e:  # a failing framework is a row, not the end of the run
            if isinstance(e, KeyboardInterrupt):
                raise
            row = {"framework": fw, "error": _failure_reason(e), "traceback": str(e)[-4000:]}
            status = "fails: " + row["error"]
        row["reduce_dtype"] = reduce_dtype_of(fw, cfg)
        row["estimated_peak_gib"] = est
        rows.append(row)
        print(f"[cuda] {fw}: {status} ({time.perf_counter() - t0:.1f} s, estimate {est:.1f} GiB/rank)", flush=True)
    targets = cuda_report(rows, cfg, params, gpus, peak_tflops)
    print(
        f"\nCUDA, NCCL, {env.get('device_name', '?')} x{gpus}, world {cfg.world}"
        f"{' (ranks share GPUs)' if cfg.world > n_dev else ''}, "
        f"{'bf16 mixed precision, fp32 master parameters' if cfg.bf16 else 'fp32'}, "
        f"{'size ' + cfg.size + ', ' if cfg.size else ''}{params:,} params ({params / 1e6:.1f}M), "
        f"{cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, seq {cfg.seq}, vocab {cfg.vocab}, "
        f"batch {cfg.batch} per rank ({cfg.batch * cfg.seq} tokens), AdamW, median of {cfg.steps} steps "
        f"after {cfg.warmup} warm-up"
    )
    print(
        f"torch {env.get('torch', torch.__version__)}, CUDA {env.get('torch_cuda')}, torch's NCCL "
        f"{env.get('torch_nccl')}, fairscale_c's NCCL {env.get('fairscale_c_nccl_version')}, driver "
        f"{env.get('fairscale_c_driver_version')}, fairscale {env.get('fairscale')}"
    )
    print_cuda_table(rows, cfg, targets, gpus, peak_tflops)
    return {
        "rows": rows,
        "targets_world1": targets,
        "env": env,
        "params": params,
        "gpus": gpus,
        "peak_tflops": peak_tflops,
        "peak_source": "H100 SXM dense bf16, NVIDIA datasheet"
        if peak_tflops == H100_SXM_BF16_DENSE_TFLOPS
        else "--peak-tflops",
        "flops_formula": FLOPS_FORMULA,
        "flops_per_token": model_flops_per_token(cfg, params),
        "shared_gpu": cfg.world > n_dev,
    }


# ---------------------------------------------------------------- main


def parse_args(argv: Optional[List[str]] = None) -> tuple:
    d = Config()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="GPU: --device cuda --size 125m|350m|1.3b --bf16 --batch B. The micro-batch is the caller's "
        "choice (no search is run): without --batch, a --size run takes the largest batch whose rough "
        "memory estimate (estimate_peak_gib) fits 75%% of the GPU memory given by --gpu-mem-gib, shared "
        "by the ranks on one GPU. Each framework runs in its own process set; a failing one is a row.",
    )
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (under a minute)")
    p.add_argument(
        "--size",
        choices=sorted(PRESETS),
        help="GPT preset: 125m (12x768), 350m (24x1024), 1.3b (24x2048); seq 1024, vocab 50304; "
        "--layers/--d-model/--heads/--seq/--vocab/--batch still override",
    )
    p.add_argument("--world", type=int, default=d.world)
    p.add_argument("--steps", type=int, default=None, help=f"timed steps (default {d.steps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps first (default {d.warmup})")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per rank per step (the micro-batch)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / world)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master parameters) everywhere")
    p.add_argument(
        "--reduce-dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="with --bf16, the gradient reduce dtype of every FSDP (FSDP2's reduce_dtype, FairScale's "
        "fp32_reduce_scatter); default fp32 for --device cuda, bf16 otherwise",
    )
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="fairscale_c's bucket_cap_mb (default 25)")
    p.add_argument(
        "--shared-rs-group",
        action="store_true",
        help="fairscale_c: process_group_reduce_scatter='default' (one group for all collectives)",
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CPU, then CUDA when available"
    )
    p.add_argument(
        "--frameworks",
        default=",".join(CUDA_FRAMEWORKS),
        help=f"comma-separated subset of {','.join(CUDA_FRAMEWORKS)} (default all, in that order; on CPU "
        "local is always run, and fairscale, whose FSDP needs CUDA, becomes a 'fails' row)",
    )
    p.add_argument(
        "--no-paired",
        action="store_true",
        help="CPU: time from the separate runs only (no paired run; the targets are then decided on them)",
    )
    p.add_argument(
        "--paired-malloc",
        choices=sorted(PAIRED_MALLOC),
        default="kept",
        help="CPU: glibc malloc settings of the paired run's processes: 'kept' (default) keeps freed memory "
        "in the heap (blocks under 32 MiB from the heap, no trimming), so that frameworks sharing one heap "
        "do not make each other fault pages in again; 'default' leaves glibc's defaults",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=H100_SXM_BF16_DENSE_TFLOPS,
        help=f"GPU peak for MFU, TFLOP/s (default {H100_SXM_BF16_DENSE_TFLOPS}: H100 SXM dense bf16, datasheet)",
    )
    p.add_argument(
        "--gpu-mem-gib", type=float, default=80.0, help="GPU memory for the default --size batch (default 80)"
    )
    p.add_argument("--profile", metavar="FILE", help="cProfile rank 0 of fairscale_c's timed steps into FILE")
    p.add_argument("--out", default=RESULTS, help="JSON results path")
    a = p.parse_args(argv)
    if a.quick and a.size:
        p.error("--quick and --size are exclusive")
    cfg = quick_config() if a.quick else preset_config(a.size) if a.size else d
    for name in ("steps", "warmup", "layers", "d_model", "heads", "seq", "vocab", "batch"):
        value = getattr(a, name)
        if value is not None:
            if value < (0 if name == "warmup" else 1):
                p.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}, got {value}")
            setattr(cfg, name, value)
    if a.world < 1:
        p.error(f"--world must be >= 1, got {a.world}")
    cfg.world, cfg.bf16 = a.world, a.bf16
    cfg.reduce_fp32 = (a.reduce_dtype or ("fp32" if a.device == "cuda" else "bf16")) == "fp32"
    if a.bucket_cap_mb is not None:
        cfg.bucket_cap_mb = a.bucket_cap_mb
    cfg.shared_rs_group = a.shared_rs_group
    cfg.threads = a.threads if a.threads else max(1, (os.cpu_count() or 1) // cfg.world)
    if cfg.d_model % cfg.heads:
        p.error("--d-model must be a multiple of --heads")
    a.frameworks = [f.strip() for f in a.frameworks.split(",") if f.strip()]
    unknown = [f for f in a.frameworks if f not in CUDA_FRAMEWORKS]
    if unknown or not a.frameworks:
        p.error(f"--frameworks: expected a comma-separated subset of {CUDA_FRAMEWORKS}, got {unknown or 'nothing'}")
    if a.peak_tflops <= 0 or a.gpu_mem_gib <= 0:
        p.error("--peak-tflops and --gpu-mem-gib must be > 0")
    a.batch_from_estimate = bool(a.size and a.batch is None)
    if a.batch_from_estimate:
        ranks_per_gpu = max(1, math.ceil(cfg.world / max(1, _gpu_count())))
        cfg.batch = pick_batch(cfg, n_params(cfg), 0.75 * a.gpu_mem_gib / ranks_per_gpu, a.frameworks)
    return a, cfg


def _gpu_count() -> int:
    """GPUs visible, without creating a CUDA context in this (parent) process; 0 without CUDA."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def main(argv: Optional[List[str]] = None) -> int:
    args, cfg = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"error: --device cuda needs a GPU, but torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}); use --device cpu",
            file=sys.stderr,
        )
        return 2
    params = n_params(cfg)
    print(f"config: {asdict(cfg)}; torch {torch.__version__}; {os.cpu_count()} CPU cores", flush=True)
    print(f"model: {params:,} parameters ({params / 1e6:.1f}M)", flush=True)
    if args.batch_from_estimate:
        print(
            f"batch {cfg.batch} per rank: the largest whose memory estimate fits 75% of {args.gpu_mem_gib:g} GiB "
            "(ranks on one GPU share it); --batch overrides",
            flush=True,
        )
    result: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "config": asdict(cfg),
        "params": params,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
    }
    if args.device in ("auto", "cpu"):
        result["cpu"] = run_cpu(
            cfg, args.profile, args.frameworks, paired=not args.no_paired, paired_malloc=args.paired_malloc
        )
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        result["cuda"] = run_cuda(cfg, args.frameworks, args.peak_tflops)
    elif args.device == "auto":
        print("[cuda] skipped: torch.cuda.is_available() is False")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
