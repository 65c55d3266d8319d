"""MoE benchmark: fairscale_c's MOELayer against FairScale 0.4.13's, at world 2 on CPU ranks, in
the same run, beside the compute floor.

    PYTHONPATH=. python benchmarks/moe.py            # tokens per rank 512, 1024, 2048, 4096
    PYTHONPATH=. python benchmarks/moe.py --quick    # 256 and 512 tokens, fewer rounds (seconds)

Two ranks (one thread each), each holding 2 experts (a 256 -> 1024 -> 256 MLP) of 4, a Top2Gate,
and a batch of T tokens of width 256. A training step: forward, loss = mean(out^2) + 0.01 l_aux,
backward, SGD step.

- fairscale_c: fairscale_c.nn.MOELayer (tokens dispatched and combined by index; the all-to-alls
  on the shared-memory engine).
- fairscale: FairScale 0.4.13's MOELayer (dense einsums over (tokens x experts x capacity); the
  all-to-alls through torch.distributed on gloo). Skipped, and said so, without fairscale.
- floor: what no MoE layer can avoid on a rank: the gate's forward and backward on its tokens and
  its experts' forward and backward on their full capacity buffers (2 ranks x capacity tokens
  each), with no dispatch, combine or communication.

"own" is a framework's step minus the floor's. "all-to-all": one all_to_all_single of the
layer's dispatch buffer (4 experts x capacity x 256 float32), fairscale_c.distributed's against
torch.distributed's on gloo (a step makes four). Timing alternates between the frameworks round by
round (the order flips every round) so load on the machine falls on all alike; each number is the
median over rounds of the slower rank's mean step. Peak memory: the rise of the process's
resident high-water mark (VmHWM, reset through /proc/self/clear_refs) over its resident size
before one step, the larger of the two ranks; the ranks run with glibc's mmap threshold fixed at
64 KiB, so freed tensors leave the resident set and it follows the live ones. Before timing, the
first step's outputs of the two MoE layers are compared (same seeds: same routing); a mismatch
stops the run.

Results go to stdout (a table) and benchmarks/results/moe.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import bench_main, max_over_ranks, peak_rise_mib, time_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "moe.json"
WORLD = 2
LOCAL = 2
WIDTH = 256
HIDDEN = 1024
FRAMEWORKS = ("fairscale_c", "fairscale", "floor")


def expert(e: int) -> nn.Module:
    torch.manual_seed(100 + e)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH))


def load_fairscale() -> Optional[Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fairscale.nn as fairscale_nn
    except ImportError:
        return None
    return fairscale_nn


class Layer:
    """One framework's layer on this rank, its optimizer and its step."""

    def __init__(self, framework: str, rank: int, tokens: int) -> None:
        import fairscale_c.nn as ours

        lib = ours if framework in ("fairscale_c", "floor") else load_fairscale()
        torch.manual_seed(0)
        self.gate = lib.Top2Gate(WIDTH, WORLD * LOCAL)
        self.experts = nn.ModuleList([expert(rank * LOCAL + i) for i in range(LOCAL)])
        self.framework = framework
        self.moe = None if framework == "floor" else lib.MOELayer(self.gate, self.experts)
        params = list(self.gate.parameters()) + list(self.experts.parameters())
        self.opt = torch.optim.SGD(params, lr=1e-3)
        g = torch.Generator().manual_seed(1000 + rank)
        self.x = torch.randn(tokens // 8, 8, WIDTH, generator=g)
        capacity = 2 * tokens // (WORLD * LOCAL)
        self.buffer = torch.randn(WORLD, 1, capacity, WIDTH, generator=g)

    def forward(self) -> torch.Tensor:
        torch.manual_seed(7)  # the gate's noise: the same draws for both layers
        if self.moe is not None:
            out = self.moe(self.x)
            return out.pow(2).mean() + 0.01 * self.moe.l_aux
        from fairscale_c.nn.moe.top2gate import top2_routing

        routing = top2_routing(self.gate.wg(self.x.reshape(-1, WIDTH)))
        outs = [e(self.buffer) for e in self.experts]
        return sum(o.pow(2).mean() for o in outs) + 0.01 * routing.l_aux + routing.weights.sum()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.forward().backward()
        self.opt.step()


def _guard(layers: Dict[str, Layer], tokens: int) -> None:
    """The two MoE layers compute the same outputs (same seeds: same routing)."""
    outs = []
    for f in ("fairscale_c", "fairscale"):
        torch.manual_seed(7)
        outs.append(layers[f].moe(layers[f].x))
    diff = (outs[0] - outs[1]).abs().max().item()
    if diff > 1e-4 * max(outs[1].abs().max().item(), 1.0):
        raise RuntimeError(f"fairscale_c and FairScale outputs differ by {diff} at {tokens} tokens")


def _all_to_all_times(tokens: int, cfg: Dict[str, Any]) -> Dict[str, float]:
    """Seconds for one all_to_all_single of a layer's dispatch buffer (experts x capacity x width
    float32), fairscale_c's against torch.distributed's on gloo: the median over rounds of the
    slower rank's mean."""
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    group = fdist.group_for(dist.group.WORLD)
    x = torch.randn(WORLD * LOCAL * (2 * tokens // (WORLD * LOCAL)) * WIDTH)
    y = torch.empty_like(x)
    ops = {"fairscale_c": lambda: group.all_to_all_single(y, x), "gloo": lambda: dist.all_to_all_single(y, x)}
    times: Dict[str, List[float]] = {k: [] for k in ops}
    reps = 4 * cfg["steps"]
    for r in range(cfg["rounds"]):
        for name in list(ops) if r % 2 == 0 else list(ops)[::-1]:
            ops[name]()  # warm
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                ops[name]()
            times[name].append(max_over_ranks((time.perf_counter() - start) / reps))
    return {k: statistics.median(v) for k, v in times.items()}


def rank_main(rank: int, cfg: Dict[str, Any], mode: str) -> Dict[str, Any]:
    """mode "time": step times; "memory": each step's peak (in processes of their own, whose
    allocator settings would slow the timed steps)."""
    frameworks = [f for f in FRAMEWORKS if f != "fairscale" or load_fairscale() is not None]
    results: Dict[str, Any] = {}
    for tokens in cfg["sizes"]:
        layers = {f: Layer(f, rank, tokens) for f in frameworks}
        if mode == "memory":
            peaks = {}
            for f, layer in layers.items():
                layer.step()  # warm-up
                peaks[f] = {"peak_mib": max_over_ranks(peak_rise_mib(layer.step))}
            results[str(tokens)] = peaks
            continue
        if "fairscale" in layers:
            _guard(layers, tokens)
        results[str(tokens)] = time_steps({f: layer.step for f, layer in layers.items()}, cfg)
        results[str(tokens)]["all_to_all"] = _all_to_all_times(tokens, cfg)
    return results


def table(results: Dict[str, Any]) -> str:
    lines = [
        "| tokens/rank | floor ms | fairscale_c ms | FairScale ms | step ratio (ours/FS) | own ms ours / FS | "
        "own ratio | peak MiB floor / ours / FS | peak ratio | all-to-all ms ours / gloo |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tokens, r in results.items():
        floor, ours = r["floor"], r["fairscale_c"]
        a2a = f"{1e3 * r['all_to_all']['fairscale_c']:.2f} / {1e3 * r['all_to_all']['gloo']:.2f} |"
        fs = r.get("fairscale")
        own = ours["step_s"] - floor["step_s"]
        if fs is None:
            lines.append(
                f"| {tokens} | {1e3 * floor['step_s']:.1f} | {1e3 * ours['step_s']:.1f} | not installed | - | "
                f"{1e3 * own:.1f} / - | - | {floor['peak_mib']:.1f} / {ours['peak_mib']:.1f} / - | - | {a2a}"
            )
            continue
        fs_own = fs["step_s"] - floor["step_s"]
        own_ratio = own / fs_own if fs_own > 0 else float("nan")
        peak_ratio = ours["peak_mib"] / fs["peak_mib"] if fs["peak_mib"] > 0 else float("nan")
        lines.append(
            f"| {tokens} | {1e3 * floor['step_s']:.1f} | {1e3 * ours['step_s']:.1f} | {1e3 * fs['step_s']:.1f} | "
            f"{ours['step_s'] / fs['step_s']:.2f} | {1e3 * own:.1f} / {1e3 * fs_own:.1f} | {own_ratio:.2f} | "
            f"{floor['peak_mib']:.1f} / {ours['peak_mib']:.1f} / {fs['peak_mib']:.1f} | {peak_ratio:.2f} | {a2a}"
        )
    return "\n".join(lines)


def parse_tokens(text: str) -> List[int]:
    tokens = [int(t) if t.strip().isdigit() else -1 for t in text.split(",")]
    if any(t <= 0 or t % 8 for t in tokens):
        raise argparse.ArgumentTypeError(f"each must be a positive multiple of 8, got {text!r}")
    return tokens


def main(argv: Optional[List[str]] = None) -> int:
    return bench_main(
        __doc__,
        argv,
        sizes_flag="--tokens",
        sizes_help="comma-separated tokens per rank (multiples of 8)",
        parse_sizes=parse_tokens,
        sizes=[512, 1024, 2048, 4096],
        quick=[256, 512],
        rank_main=rank_main,
        world=WORLD,
        table=table,
        results_path=str(RESULTS),
        peer_installed=load_fairscale() is not None,
    )


if __name__ == "__main__":
    sys.exit(main())
