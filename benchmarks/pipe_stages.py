"""Multi-process pipeline benchmark: fairscale_c.nn.pipe (PipelineStage, ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS) vs torch.distributed.pipelining (gloo),
2 ranks on CPU, same model, same data, same micro-batch counts, in the same processes.

    PYTHONPATH=. python benchmarks/pipe_stages.py          # d=512, 4 layers per rank, batch 480, m = 4..16
    PYTHONPATH=. python benchmarks/pipe_stages.py --quick  # small model, few steps (under a minute)
    PYTHONPATH=. python benchmarks/pipe_stages.py --device cuda   # the same on GPUs, NCCL (see below)

`--device cuda`: rank r on cuda:r % device_count (two ranks may share one GPU with NCCL >= 2.30,
NCCL_MULTI_RANK_GPU_ENABLE=1, set by the script), torch's group "cpu:gloo,cuda:nccl" (its
pipelining sends CUDA tensors over NCCL), fairscale_c's stages over its own NCCL communicators.
Default model there: d=2048, 8 layers per rank, batch 3072, 10 rounds (cuda_config). Step times are taken
with torch.cuda.synchronize() at both ends, forward/backward compute with CUDA events, and each
configuration's memory steps also report torch.cuda.max_memory_allocated above the allocation at
their start. Two ranks sharing one GPU time-slice it: a compute interval then includes the other
rank's kernels, so the measured bubble means little there. Results: results/pipe_stages_cuda.json.

The model: 2 x `--layers` x (Linear(d, d), ReLU), MSE loss on the last stage, SGD; GPipe and 1F1B
run it as 2 stages (one per rank), the interleaved and looped-BFS schedules as 4 stages (2 per
rank: rank r holds stages r and r + 2).
Two rank processes (one per stage, one torch thread each) live for the whole run (benchmarks/
_harness.RankPool); every configuration (framework x schedule x micro-batches) is timed in turn
within each round, so load on the machine falls on all of them alike; the median over rounds is
reported.

Reported per configuration:
  * throughput: samples/s = batch / step time, where a step is zero_grad + schedule.step +
    optimizer.step and the step time is the slowest rank's time for `--steps` back-to-back steps
    divided by their number (median over rounds); ratios are medians over rounds of the ratio
    within a round (configurations run back to back, so a change of load between rounds falls on
    both sides of a ratio);
  * peak activation memory per stage: the most bytes autograd held for backward at once (distinct
    storages saved by the stage's module, parameters excluded), counted by saved-tensor hooks
    in separate, untimed steps; allocator-independent, so it is comparable between frameworks;
  * bubble per stage: 1 - (forward + backward compute time) / step time, with compute timed the
    same way for both frameworks (the module's forward; backward from the gradient reaching the
    stage's output to the last parameter gradient accumulated), against the ideal
    (p - 1) / (m + p - 1), and (p - 1) / (2m + p - 1) for the schedules of 2 stages per rank;
  * critical path: the step's length if every message cost nothing, each rank running the
    schedule's actions in order at the measured speed of its compute (per rank: forward, the
    loss's forward, backward, optimizer step; the faster framework's median over rounds; the loss's
    backward and zero_grad are left out, so it is a lower bound). torch's step over it is the most
    any framework running this schedule could be ahead of torch on this machine at that moment.

Targets (printed as verdict lines): throughput >= 1.2x torch.distributed.pipelining's with the same
schedule; fairscale_c's 1F1B peak activation memory <= its GPipe's at equal throughput (+-5%; a
1F1B that is faster than that passes too). `--report FILE` prints the table of a saved JSON.
Results go to stdout and benchmarks/results/pipe_stages.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import RankPool, RankState, check_cuda_ranks, cuda_info  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipe_stages.json")
RESULTS_CUDA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipe_stages_cuda.json")
FRAMEWORKS = ("fairscale_c", "torch")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs")
MULTI = ("interleaved", "looped_bfs")  # the schedules of INTERLEAVE stages per rank
INTERLEAVE = 2  # stages per rank of the interleaved and looped-BFS schedules
TARGET_THROUGHPUT_RATIO = 1.2
TARGET_EQUAL_THROUGHPUT = 0.05
STAGES = 2
COMPUTE_KINDS = ("fwd", "bwd", "loss", "opt")  # a rank's measured compute: forward, backward, loss, optimizer


@dataclass
class Config:
    d: int = 512
    layers: int = 4  # (Linear, ReLU) pairs per stage
    batch: int = 480
    microbatches: List[int] = field(default_factory=lambda: [4, 8, 12, 16])
    steps: int = 4  # timed steps per configuration per round
    rounds: int = 15
    warmup: int = 2
    memory_steps: int = 2
    lr: float = 1e-3
    seed: int = 0
    schedules: List[str] = field(default_factory=lambda: list(SCHEDULES))


def quick_config() -> Config:
    return Config(d=128, layers=2, batch=48, microbatches=[4, 8, 12, 16], steps=4, rounds=3, warmup=1, memory_steps=1)


def cuda_config() -> Config:
    """The default model of --device cuda: 16 x Linear(2048, 2048), 67M parameters, batch 3072
    (1.2 TFLOP per step; 192 rows per micro-batch at m = 16), so that a micro-batch's matrix
    products are not all launch overhead; 10 rounds (GPU times vary less than a loaded CPU's)."""
    return Config(d=2048, layers=8, batch=3072, rounds=10)


# ---------------------------------------------------------------- instrumentation (both frameworks)


class _Saved:
    """A tensor autograd saved for backward, counted while the graph holds it."""

    __slots__ = ("tracker", "t", "ptr")

    def __init__(self, tracker: "_Tracker", t: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.tracker, self.t, self.ptr = tracker, t, ptr
        entry = tracker.live.get(ptr)
        if entry is None:
            tracker.live[ptr] = [1, nbytes]
            tracker.cur += nbytes
            tracker.peak = max(tracker.peak, tracker.cur)
        else:
            entry[0] += 1

    def __del__(self) -> None:
        entry = self.tracker.live[self.ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self.tracker.live[self.ptr]
            self.tracker.cur -= entry[1]


class _Tracker:
    """Bytes of distinct tensors autograd holds for backward (parameters excluded)."""

    def __init__(self, skip: set) -> None:
        self.skip, self.live, self.cur, self.peak = skip, {}, 0, 0

    def pack(self, t: torch.Tensor) -> Any:
        # a view counts for its own bytes (stage 0's micro-batches are views of the whole batch)
        if t.untyped_storage().data_ptr() in self.skip or t.numel() == 0:
            return t
        return _Saved(self, t, t.data_ptr(), t.numel() * t.element_size())

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.t if isinstance(saved, _Saved) else saved


class _Exit(torch.autograd.Function):
    """Identity whose backward marks the moment a stage's backward starts."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, meter: "Meter") -> torch.Tensor:
        ctx.meter = meter
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.meter.backward_starts()
        return grad, None


class Meter:
    """One rank's compute clock and activation count, shared by the Probes of its stages.

    On CPU the clock is time.perf_counter(). With `cuda`, compute is asynchronous: the same
    moments are CUDA events recorded on the current stream, and their intervals are added to
    fwd_s / bwd_s by collect(), after the caller has synchronised."""

    def __init__(self, cuda: bool = False) -> None:
        self.params: List[torch.Tensor] = []
        self.tracker: Optional[_Tracker] = None
        self.fwd_s = self.bwd_s = 0.0
        self.other_s: Dict[str, float] = {"loss": 0.0, "opt": 0.0}  # the loss's forward, optimizer.step
        self._bwd_open: Optional[Any] = None
        self._last_grad: Any = 0.0
        self.cuda = cuda
        self._intervals: List[tuple] = []  # CUDA: ("fwd" | "bwd", start event, end event)

    def mark(self) -> Any:
        """Now: a perf_counter() reading, or (CUDA) an event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def add_forward(self, start: Any) -> None:
        if self.cuda:
            self._intervals.append(("fwd", start, self.mark()))
        else:
            self.fwd_s += time.perf_counter() - start

    def add(self, kind: str, start: Any) -> None:
        """An interval of `kind` ("loss" or "opt") from `start` to now."""
        if self.cuda:
            self._intervals.append((kind, start, self.mark()))
        else:
            self.other_s[kind] += time.perf_counter() - start

    def watch(self, module: torch.nn.Module) -> None:
        for p in module.parameters():
            self.params.append(p)
            p.register_post_accumulate_grad_hook(self._grad_done)

    def _grad_done(self, _p: torch.Tensor) -> None:
        self._last_grad = self.mark()

    def backward_starts(self) -> None:
        self.flush()
        if self.cuda:
            self._last_grad = None  # an interval with no parameter gradient after its start counts 0
        self._bwd_open = self.mark()

    def flush(self) -> None:
        """Close the open backward interval: it ended at the last parameter gradient."""
        if self._bwd_open is not None:
            if not self.cuda:
                self.bwd_s += max(0.0, self._last_grad - self._bwd_open)
            elif self._last_grad is not None:
                self._intervals.append(("bwd", self._bwd_open, self._last_grad))
            self._bwd_open = None

    def collect(self) -> None:
        """CUDA: add the recorded intervals to fwd_s / bwd_s (every event must have completed:
        call after torch.cuda.synchronize())."""
        for kind, start, end in self._intervals:
            seconds = start.elapsed_time(end) / 1e3
            if kind == "fwd":
                self.fwd_s += seconds
            elif kind == "bwd":
                self.bwd_s += seconds
            else:
                self.other_s[kind] += seconds
        self._intervals = []

    def reset(self, track: bool) -> None:
        self.flush()
        self._intervals = []
        self.fwd_s = self.bwd_s = 0.0
        self.other_s = {"loss": 0.0, "opt": 0.0}
        self.tracker = _Tracker({p.untyped_storage().data_ptr() for p in self.params}) if track else None


class Probe(torch.nn.Module):
    """Wraps a stage's module: times its forward and backward on a Meter and (when tracking)
    counts the activations autograd saves for it."""

    def __init__(self, inner: torch.nn.Module, meter: Meter) -> None:
        super().__init__()
        self.inner = inner
        self.meter = meter
        meter.watch(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meter = self.meter
        t0 = meter.mark()
        if meter.tracker is not None:
            with torch.autograd.graph.saved_tensors_hooks(meter.tracker.pack, meter.tracker.unpack):
                out = self.inner(x)
        else:
            out = self.inner(x)
        meter.add_forward(t0)
        if out.requires_grad:
            out = _Exit.apply(out, meter)
        return out


# ---------------------------------------------------------------- rank side


def _stage_modules(cfg: Config, rank: int, chunks: int, device: Any = "cpu") -> List[torch.nn.Module]:
    """This rank's parts of the whole model (the same seeded model every time, built on the CPU)
    cut into STAGES * chunks stages, on `device`; stage k runs on rank k % STAGES."""
    torch.manual_seed(cfg.seed)
    full = []
    for _ in range(STAGES * cfg.layers):
        full += [torch.nn.Linear(cfg.d, cfg.d), torch.nn.ReLU()]
    per = 2 * cfg.layers // chunks
    return [
        torch.nn.Sequential(*full[k * per : (k + 1) * per]).to(device) for k in range(rank, STAGES * chunks, STAGES)
    ]


def rank_setup(state: RankState, cfg_dict: Dict[str, Any]) -> None:
    """Rank command: build the stage module, its data and one schedule per configuration."""
    import torch.nn.functional as F
    from torch.distributed import pipelining as tpp

    from fairscale_c.nn import pipe as fpp

    cfg = Config(**cfg_dict)
    rank = state.rank
    cuda = state.device == "cuda"
    # CUDA: the pool made this rank's GPU the current device (_harness.rank_cuda_device)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    meters = {"plain": Meter(cuda), "interleaved": Meter(cuda)}
    probe = Probe(_stage_modules(cfg, rank, 1, dev)[0], meters["plain"])
    probes = [Probe(mod, meters["interleaved"]) for mod in _stage_modules(cfg, rank, INTERLEAVE, dev)]

    def timed_loss(meter: Meter) -> Any:
        def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            t0 = meter.mark()
            value = F.mse_loss(out, target)
            meter.add("loss", t0)
            return value

        return loss

    mse, mse_i = timed_loss(meters["plain"]), timed_loss(meters["interleaved"])
    g = torch.Generator().manual_seed(cfg.seed + 1)
    x, y = torch.randn(cfg.batch, cfg.d, generator=g), torch.randn(cfg.batch, cfg.d, generator=g)
    if cuda:
        x, y = x.to(dev), y.to(dev)
    scheds: Dict[tuple, Any] = {}
    for m in cfg.microbatches:
        sample = torch.empty(cfg.batch // m, cfg.d, device=dev)
        for name in [s for s in ("gpipe", "1f1b") if s in cfg.schedules]:
            ours = {"gpipe": fpp.ScheduleGPipe, "1f1b": fpp.Schedule1F1B}[name]
            theirs = {"gpipe": tpp.ScheduleGPipe, "1f1b": tpp.Schedule1F1B}[name]
            scheds[("fairscale_c", name, m)] = ours(fpp.PipelineStage(probe, rank, STAGES), m, mse)
            tstage = tpp.PipelineStage(probe, rank, STAGES, dev, input_args=(sample,))
            scheds[("torch", name, m)] = theirs(tstage, m, loss_fn=mse)
        n, ks = STAGES * INTERLEAVE, range(rank, STAGES * INTERLEAVE, STAGES)
        for name in [s for s in MULTI if s in cfg.schedules]:
            ours = {"interleaved": fpp.ScheduleInterleaved1F1B, "looped_bfs": fpp.ScheduleLoopedBFS}[name]
            theirs = {"interleaved": tpp.ScheduleInterleaved1F1B, "looped_bfs": tpp.ScheduleLoopedBFS}[name]
            scheds[("fairscale_c", name, m)] = ours(
                [fpp.PipelineStage(pr, k, n) for pr, k in zip(probes, ks)], m, mse_i
            )
            tstages = [tpp.PipelineStage(pr, k, n, dev, input_args=(sample,)) for pr, k in zip(probes, ks)]
            scheds[("torch", name, m)] = theirs(tstages, m, loss_fn=mse_i)
    params = list(probe.parameters()) + [p for pr in probes for p in pr.parameters()]
    opt = torch.optim.SGD(params, lr=cfg.lr)
    state.case = {"cfg": cfg, "meters": meters, "x": x, "y": y, "scheds": scheds, "opt": opt}


def _one_step(state: RankState, sched: Any, meter: Optional[Meter] = None) -> None:
    c = state.case
    c["opt"].zero_grad(set_to_none=True)
    if state.rank == 0:
        sched.step(c["x"])
    else:
        sched.step(target=c["y"], losses=[])
    t0 = meter.mark() if meter is not None else None
    c["opt"].step()
    if meter is not None:
        meter.add("opt", t0)


def schedule_orders(state: RankState) -> Dict[str, List[tuple]]:
    """Rank command: this rank's actions in fairscale_c's order for each schedule and micro-batch
    count, as (kind, micro-batch, global stage index)."""
    out = {}
    for (fw, name, m), sched in state.case["scheds"].items():
        if fw == "fairscale_c":
            stages = [st.stage_index for st in sched.stages]
            out[f"{name}/{m}"] = [(a.kind, a.mb, stages[a.stage]) for a in sched.order()]
    return out


def critical_path(orders: List[List[tuple]], action_s: List[Dict[str, float]], n_stages: int) -> float:
    """The step's length if every message cost nothing: each rank runs its actions in `orders`
    order, a forward once the previous stage's forward of that micro-batch is done, a backward once
    the next stage's backward of it is; then its optimizer step. action_s[r]: rank r's seconds per
    forward ("fwd", on the last stage plus "loss"), per backward ("bwd") and per step ("opt")."""
    done: Dict[tuple, float] = {}
    nxt, free = [0] * len(orders), [0.0] * len(orders)
    while any(i < len(o) for i, o in zip(nxt, orders)):
        moved = False
        for r, order in enumerate(orders):
            while nxt[r] < len(order):
                kind, mb, s = order[nxt[r]]
                dep = None
                if kind == "F" and s > 0:
                    dep = ("F", s - 1, mb)
                elif kind == "B" and s < n_stages - 1:
                    dep = ("B", s + 1, mb)
                if dep is not None and dep not in done:
                    break
                cost = action_s[r]["fwd"] + (action_s[r]["loss"] if s == n_stages - 1 else 0.0)
                start = max(free[r], done[dep] if dep is not None else 0.0)
                free[r] = done[(kind, s, mb)] = start + (cost if kind == "F" else action_s[r]["bwd"])
                nxt[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("critical_path: the ranks' orders wait on each other")
    return max(f + a["opt"] for f, a in zip(free, action_s))


def run_case(state: RankState, framework: str, schedule: str, m: int, steps: int, track: bool) -> Dict[str, float]:
    """Rank command: `steps` back-to-back steps of one configuration after a barrier. Returns this
    rank's elapsed time, compute times and (when tracking) peak saved activation bytes; on CUDA
    (when tracking) also the peak of torch.cuda.max_memory_allocated above the allocation at the
    start, as "cuda_peak_bytes"."""
    c = state.case
    sched = c["scheds"][(framework, schedule, m)]
    meter = c["meters"]["interleaved" if schedule in MULTI else "plain"]
    meter.reset(track)
    cuda = state.device == "cuda"
    if cuda:
        torch.cuda.synchronize()  # nothing of the previous configuration left running
        if track:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
    state.group.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        _one_step(state, sched, meter)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    meter.flush()
    if cuda:
        meter.collect()
    out = {"elapsed_s": elapsed, "fwd_s": meter.fwd_s, "bwd_s": meter.bwd_s, "peak_bytes": 0}
    out.update({f"{k}_s": v for k, v in meter.other_s.items()})
    if meter.tracker is not None:
        out["peak_bytes"] = meter.tracker.peak
        if cuda:
            out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    meter.reset(False)
    return out


def check_losses(state: RankState, m: int) -> Dict[str, List[float]]:
    """Rank command: from the same parameters, one step of every framework and schedule at `m`
    micro-batches without optimizer steps; the last stage returns the per-micro-batch losses."""
    c = state.case
    params = c["opt"].param_groups[0]["params"]
    saved = [p.detach().clone() for p in params]

    def restore() -> None:
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)

    out = {}
    for fw in FRAMEWORKS:
        for name in c["cfg"].schedules:
            restore()
            losses: list = []
            c["opt"].zero_grad(set_to_none=True)
            sched = c["scheds"][(fw, name, m)]
            if state.rank == 0:
                sched.step(c["x"])
            else:
                sched.step(target=c["y"], losses=losses)
            out[f"{fw}/{name}"] = [float(v.detach()) for v in losses]
    restore()
    return out


# ---------------------------------------------------------------- driver


def _run_case_timed(pool: RankPool, fw: str, name: str, m: int, steps: int, track: bool) -> Dict[str, Any]:
    """Wraps run_case; the per-step time is the slowest rank's elapsed / steps."""
    res = pool.run(run_case, fw, name, m, steps, track)
    step_s = max(r["elapsed_s"] for r in res) / steps
    bubbles = [1.0 - (r["fwd_s"] + r["bwd_s"]) / r["elapsed_s"] for r in res]
    out = {"step_s": step_s, "bubble": bubbles, "peak_bytes": [r["peak_bytes"] for r in res]}
    # per rank and step: seconds of forward, backward, loss and optimizer step
    out["compute"] = [{k: r[f"{k}_s"] / steps for k in COMPUTE_KINDS} for r in res]
    if "cuda_peak_bytes" in res[0]:
        out["cuda_peak_bytes"] = [r["cuda_peak_bytes"] for r in res]
    return out


def run(cfg: Config, device: str = "cpu") -> Dict[str, Any]:
    rows: Dict[tuple, Dict[str, Any]] = {}
    with RankPool(STAGES, device=device) as pool:
        pool.run(rank_setup, asdict(cfg))
        keys = [(fw, name, m) for m in cfg.microbatches for name in cfg.schedules for fw in FRAMEWORKS]
        for key in keys:  # warm-up: set-up exchanges, first-touch of buffers, lazy imports
            pool.run(run_case, *key, cfg.warmup, False)
        times: Dict[tuple, List[float]] = {k: [] for k in keys}
        bubbles: Dict[tuple, List[List[float]]] = {k: [] for k in keys}
        compute: Dict[tuple, List[List[Dict[str, float]]]] = {k: [] for k in keys}
        for r in range(cfg.rounds):
            order = keys if r % 2 == 0 else list(reversed(keys))
            for key in order:
                res = _run_case_timed(pool, *key, cfg.steps, False)
                times[key].append(res["step_s"])
                bubbles[key].append(res["bubble"])
                compute[key].append(res["compute"])
        mem = {k: _run_case_timed(pool, *k, cfg.memory_steps, True) for k in keys}
        peaks = {k: v["peak_bytes"] for k, v in mem.items()}
        check = pool.run(check_losses, cfg.microbatches[0])[STAGES - 1]
        orders = pool.run(schedule_orders)
    # per configuration, rank and kind of work: seconds per step, median over rounds
    medians = {
        key: [{k: statistics.median(c[r][k] for c in compute[key]) for k in COMPUTE_KINDS} for r in range(STAGES)]
        for key in keys
    }
    floors = {}
    for name in cfg.schedules:
        for m in cfg.microbatches:
            # per action: the faster framework's median
            v = INTERLEAVE if name in MULTI else 1
            per_action = []
            for r in range(STAGES):
                med = {k: min(medians[(fw, name, m)][r][k] for fw in FRAMEWORKS) for k in COMPUTE_KINDS}
                per_mb = {"fwd": med["fwd"] / (m * v), "bwd": med["bwd"] / (m * v), "loss": med["loss"] / m}
                per_action.append({**per_mb, "opt": med["opt"]})
            floors[(name, m)] = critical_path([o[f"{name}/{m}"] for o in orders], per_action, STAGES * v)
    for key in keys:
        fw, name, m = key
        step_s = statistics.median(times[key])
        per_stage_bubble = [statistics.median(b[s] for b in bubbles[key]) for s in range(STAGES)]
        rows[key] = {
            "framework": fw,
            "schedule": name,
            "microbatches": m,
            "step_s": step_s,
            "step_s_rounds": times[key],
            "samples_per_s": cfg.batch / step_s,
            "samples_per_s_best": cfg.batch / min(times[key]),
            "bubble_per_stage": per_stage_bubble,
            "bubble_mean": statistics.mean(per_stage_bubble),
            "bubble_ideal": (STAGES - 1) / (m * (INTERLEAVE if name in MULTI else 1) + STAGES - 1),
            "peak_activation_bytes_per_stage": peaks[key],
            "critical_path_s": floors[(name, m)],
            "compute_s_per_rank": medians[key],
        }
        if "cuda_peak_bytes" in mem[key]:
            rows[key]["cuda_peak_bytes_per_stage"] = mem[key]["cuda_peak_bytes"]
    # the schedules of two stages per rank train other module objects (same initial values), so each
    # framework's losses are compared with torch's on the same schedule
    loss_diff = {k: max(abs(a - b) for a, b in zip(v, check["torch/" + k.split("/")[1]])) for k, v in check.items()}
    return {"rows": list(rows.values()), "max_loss_diff_vs_torch_same_schedule": loss_diff}


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def paired_ratio(faster: Dict[str, Any], slower: Dict[str, Any]) -> float:
    """Median over rounds of slower's step time / faster's in the same round: the throughput ratio,
    paired by round so that load which changes from round to round falls on both."""
    return statistics.median(b / a for a, b in zip(faster["step_s_rounds"], slower["step_s_rounds"]))


def report(result: Dict[str, Any], cfg: Config) -> List[str]:
    rows = {(r["framework"], r["schedule"], r["microbatches"]): r for r in result["rows"]}
    # CUDA runs add torch.cuda.max_memory_allocated above each memory step's start, per stage
    cuda_mem = all("cuda_peak_bytes_per_stage" in r for r in result["rows"])
    lines = [
        "| schedule | m | fairscale_c samples/s | torch samples/s | ratio | fairscale_c peak act. MiB (stage 0 / 1) "
        "| torch peak act. MiB (stage 0 / 1) | bubble fairscale_c (s0 / s1) | bubble torch (s0 / s1) | ideal "
        "| critical path ms | fairscale_c step ÷ path | torch step ÷ path |"
        + (" fairscale_c CUDA peak MiB (s0 / s1) | torch CUDA peak MiB (s0 / s1) |" if cuda_mem else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if cuda_mem else ""),
    ]
    verdicts = []
    for name in cfg.schedules:
        for m in cfg.microbatches:
            a, b = rows[("fairscale_c", name, m)], rows[("torch", name, m)]
            ratio = paired_ratio(a, b)
            pa, pb = a["peak_activation_bytes_per_stage"], b["peak_activation_bytes_per_stage"]
            ba, bb = a["bubble_per_stage"], b["bubble_per_stage"]
            extra = ""
            if cuda_mem:
                ca, cb = a["cuda_peak_bytes_per_stage"], b["cuda_peak_bytes_per_stage"]
                extra = f" {_mib(ca[0])} / {_mib(ca[1])} | {_mib(cb[0])} / {_mib(cb[1])} |"
            path = a.get("critical_path_s")  # absent from results saved before it was measured
            floor = (
                f"| {path * 1e3:.1f} | {a['step_s'] / path:.3f} | {b['step_s'] / path:.3f} " if path else "| – | – | – "
            )
            lines.append(
                f"| {name} | {m} | {a['samples_per_s']:.0f} | {b['samples_per_s']:.0f} | {ratio:.2f} "
                f"| {_mib(pa[0])} / {_mib(pa[1])} | {_mib(pb[0])} / {_mib(pb[1])} "
                f"| {ba[0]:.2f} / {ba[1]:.2f} | {bb[0]:.2f} / {bb[1]:.2f} | {a['bubble_ideal']:.2f} {floor}|" + extra
            )
            reach = (
                f"; with free messages at most {b['step_s'] / path:.2f}x (torch's step over the critical path; "
                f"ours is {a['step_s'] / path:.2f}x the path)"
                if path
                else ""
            )
            verdicts.append(
                f"{'MET   ' if ratio >= TARGET_THROUGHPUT_RATIO else 'MISSED'} throughput {name} m={m}: "
                f"{ratio:.2f}x torch.distributed.pipelining (target >= {TARGET_THROUGHPUT_RATIO}x){reach}"
            )
    for m in cfg.microbatches if {"gpipe", "1f1b"} <= set(cfg.schedules) else []:
        g, o = rows[("fairscale_c", "gpipe", m)], rows[("fairscale_c", "1f1b", m)]
        mem_g, mem_o = max(g["peak_activation_bytes_per_stage"]), max(o["peak_activation_bytes_per_stage"])
        tr = paired_ratio(o, g)
        ok = mem_o <= mem_g and tr >= 1 - TARGET_EQUAL_THROUGHPUT
        verdicts.append(
            f"{'MET   ' if ok else 'MISSED'} 1F1B memory m={m}: peak activations {_mib(mem_o)} MiB vs GPipe "
            f"{_mib(mem_g)} MiB (max over stages; target <=), throughput 1F1B/GPipe {tr:.3f} (target >= "
            f"{1 - TARGET_EQUAL_THROUGHPUT:.2f}: equal within {TARGET_EQUAL_THROUGHPUT:.0%}, or faster)"
        )
    return lines + [""] + verdicts


def _git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)

    try:
        sha, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_args(argv: Optional[List[str]] = None) -> tuple:
    d, dc = Config(), cuda_config()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, few steps")
    p.add_argument("--d", type=int, default=None, help=f"layer width (default {d.d}; {dc.d} with --device cuda)")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"(Linear, ReLU) pairs per stage (default {d.layers}; {dc.layers} with --device cuda)",
    )
    p.add_argument(
        "--batch", type=int, default=None, help=f"samples per step (default {d.batch}; {dc.batch} with --device cuda)"
    )
    p.add_argument("--microbatches", type=int, nargs="+", default=None, help="micro-batch counts (default 4 8 12 16)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument(
        "--schedules", nargs="+", choices=SCHEDULES, default=None, help=f"schedules to run (default all: {SCHEDULES})"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (gloo, shared-memory engine) or cuda (NCCL; rank r on cuda:r %% device_count, two ranks may "
        "share one GPU with NCCL >= 2.30)",
    )
    p.add_argument("--out", default=None, help=f"JSON results path (default {RESULTS}, or {RESULTS_CUDA} for cuda)")
    p.add_argument("--report", metavar="FILE", help="print the table and verdicts of a saved JSON, run nothing")
    a = p.parse_args(argv)
    if a.out is None:
        a.out = RESULTS_CUDA if a.device == "cuda" else RESULTS
    cfg = quick_config() if a.quick else (dc if a.device == "cuda" else d)
    for name in ("d", "layers", "batch", "microbatches", "steps", "rounds", "schedules"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    if cfg.layers % INTERLEAVE:
        p.error(
            f"--layers must be a multiple of {INTERLEAVE} (stages per rank of the interleaved and looped-BFS schedules)"
        )
    bad = [m for m in cfg.microbatches if m < STAGES or m % STAGES or cfg.batch % m]
    if bad:
        p.error(f"micro-batch counts must be multiples of {STAGES} that divide --batch {cfg.batch}; not {bad}")
    return a, cfg


def main(argv: Optional[List[str]] = None) -> int:
    args, cfg = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        print("\n".join(report(saved["cuda"] if "cuda" in saved else saved["cpu"], Config(**saved["config"]))))
        return 0
    cuda_note = check_cuda_ranks(STAGES) if args.device == "cuda" else None  # exits when CUDA cannot run
    load_before = os.getloadavg()
    print(f"config: {asdict(cfg)}; torch {torch.__version__}; {os.cpu_count()} cores; load {load_before}", flush=True)
    t0 = time.time()
    result: Dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "config": asdict(cfg),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg_before": load_before,
    }
    key = args.device
    if cuda_note is not None:
        result.update(cuda_info(), device="cuda", cuda_ranks=cuda_note)
        print(f"[cuda] {cuda_note}", flush=True)
    result[key] = run(cfg, args.device)
    result["loadavg_after"] = os.getloadavg()
    result["wall_s"] = time.time() - t0
    lines = report(result[key], cfg)
    result["verdicts"] = [ln for ln in lines if ln.startswith(("MET", "MISSED"))]
    if cuda_note is None:
        print(f"\nCPU, 2 stages, d={cfg.d}, {cfg.layers} layers per stage, batch {cfg.batch}; torch: gloo")
    else:
        print(
            f"\nCUDA ({result['gpu']}), 2 stages, d={cfg.d}, {cfg.layers} layers per stage, batch {cfg.batch}, fp32; "
            f"torch: nccl (group cpu:gloo,cuda:nccl); fairscale_c: its NCCL communicators; {cuda_note}"
        )
        print(
            "compute (for the bubble) timed with CUDA events; CUDA peak = torch.cuda.max_memory_allocated during "
            f"{cfg.memory_steps} step(s) above the allocation at their start (activations, gradients, buffers)"
        )
    print("\n".join(lines))
    diffs = result[key]["max_loss_diff_vs_torch_same_schedule"]
    print(f"max |loss - torch's with the same schedule| at m={cfg.microbatches[0]}: {diffs}")
    print(f"load average before {load_before}, after {result['loadavg_after']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
