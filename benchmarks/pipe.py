"""Pipe benchmark: fairscale_c.nn.Pipe against FairScale 0.4.13's Pipe, in the same run.

    PYTHONPATH=. python benchmarks/pipe.py                 # = `single`
    PYTHONPATH=. python benchmarks/pipe.py single --quick  # small model, chunks 1, 2, 4 (seconds)
    PYTHONPATH=. python benchmarks/pipe.py single --unshared  # + fairscale_c without thread sharing
    PYTHONPATH=. python benchmarks/pipe.py multi [--quick] # 2 stages in 2 processes (benchmarks/pipe_stages.py)

`single` (one process, CPU): the same MLP split in two partitions on devices=["cpu", "cpu"], for
each chunk count (default 1..16) a training step (forward, loss, backward, SGD step) timed for
both Pipes on identical copies of the model and the same batches. Timing alternates between the
two frameworks round by round (the order flips every round), so load on the machine falls on
both alike; a framework's throughput is the median over rounds of samples per second, and
"paired" is the median over rounds of the two frameworks' ratio within a round. Before
timing, the first step's loss and gradients of the two are compared (a guard against timing a
run that computes something else). Without fairscale installed, its column says so and only
fairscale_c is timed.

Target: fairscale_c's throughput >= FairScale's at every chunk count.

`--unshared` times a third Pipe in the same rounds: fairscale_c with every CPU partition using
torch's full thread count (the partitions' thread sharing switched off, docs/pipe.md), and
prints the paired ratio of the default to it.

`multi` (two processes, one stage each, CPU): fairscale_c's GPipe, 1F1B and interleaved 1F1B
schedules against torch.distributed.pipelining (gloo); its arguments and output are
benchmarks/pipe_stages.py's, which it runs.

Results go to stdout (a table) and benchmarks/results/pipe.json (key "single").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipe.json")


@dataclass
class SingleConfig:
    layers: int = 8  # Linear + ReLU pairs; half in each partition
    width: int = 1024
    batch: int = 256
    chunks: str = "1-16"
    checkpoint: str = "except_last"
    rounds: int = 7
    steps: int = 2  # steps per round
    warmup: int = 2
    threads: int = 0  # torch intra-op threads (0: torch's default)


def quick_single() -> SingleConfig:
    return SingleConfig(layers=4, width=256, batch=64, chunks="1,2,4", rounds=3, steps=2, warmup=1)


def parse_chunks(text: str) -> List[int]:
    out: List[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    if not out or any(c < 1 for c in out):
        raise ValueError(f"--chunks must list positive integers (e.g. 1-16 or 1,2,4), got {text!r}")
    return out


def build_model(cfg: SingleConfig) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(cfg.layers):
        layers += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
    return nn.Sequential(*layers)


def load_fairscale_pipe() -> Optional[type]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fairscale.nn import Pipe as FairScalePipe
    except ImportError:
        return None
    return FairScalePipe


class Trainer:
    """One framework's Pipe, its optimizer and a step function."""

    def __init__(self, pipe_cls: type, cfg: SingleConfig, chunks: int) -> None:
        model = build_model(cfg)
        half = len(model) // 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FairScale's DeprecationWarning
            self.pipe = pipe_cls(
                model, [half, len(model) - half], devices=["cpu", "cpu"], chunks=chunks, checkpoint=cfg.checkpoint
            )
        self.opt = torch.optim.SGD(self.pipe.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor, target: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.pipe(x), target)
        loss.backward()
        self.opt.step()
        return loss.item()


def minor_faults() -> int:
    """The process's minor page faults so far (0 where getrusage is unavailable)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_steps(step: Callable[[], Any], steps: int) -> Tuple[float, float]:
    """Seconds per step and minor page faults per step (memory the allocator gave back to the
    system and took again: a cost that depends on the allocation pattern, not on the arithmetic)."""
    faults = minor_faults()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps, (minor_faults() - faults) / steps


UNSHARED = "fairscale_c_unshared"


def run_single(cfg: SingleConfig, unshared: bool = False) -> Dict[str, Any]:
    import fairscale_c.nn

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    fairscale_pipe = load_fairscale_pipe()
    frameworks: Dict[str, type] = {"fairscale_c": fairscale_c.nn.Pipe}
    if fairscale_pipe is None:
        print("FairScale: not installed (pip install fairscale==0.4.13) -- its column is skipped", flush=True)
    else:
        frameworks = {"fairscale": fairscale_pipe, **frameworks}
    if unshared:
        frameworks[UNSHARED] = fairscale_c.nn.Pipe
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.batch, cfg.width, generator=gen)
    target = torch.randn(cfg.batch, cfg.width, generator=gen)
    rows = []
    header = (
        f"{'chunks':>6} {'fairscale samples/s':>20} {'fairscale_c samples/s':>22} {'ratio':>6} {'paired':>7}"
        f" {'faults/step (fairscale, fairscale_c)':>38}"
        + (f" {'unshared samples/s':>19} {'shared/unshared':>16}" if unshared else "")
    )
    print(header, flush=True)
    for chunks in parse_chunks(cfg.chunks):
        trainers = {name: Trainer(cls, cfg, chunks) for name, cls in frameworks.items()}
        if unshared:
            trainers[UNSHARED].pipe._pipeline.share_threads = False
        _guard(trainers, x, target)
        for t in trainers.values():
            for _ in range(cfg.warmup):
                t.step(x, target)
        per_round: Dict[str, List[float]] = {name: [] for name in trainers}
        faults: Dict[str, List[float]] = {name: [] for name in trainers}
        names = list(trainers)
        for r in range(cfg.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                seconds, step_faults = time_steps(lambda t=trainers[name]: t.step(x, target), cfg.steps)
                per_round[name].append(cfg.batch / seconds)
                faults[name].append(step_faults)
        row: Dict[str, Any] = {"chunks": chunks}
        for name, values in per_round.items():
            row[name] = {
                "samples_per_s": statistics.median(values),
                "rounds": values,
                "minor_faults_per_step": statistics.median(faults[name]),
            }
        ours = row["fairscale_c"]["samples_per_s"]
        theirs = row.get("fairscale", {}).get("samples_per_s")
        row["ratio"] = ours / theirs if theirs else None
        if theirs:  # the two measured back to back in each round: their ratio cancels slow drifts in load
            paired = [a / b for a, b in zip(per_round["fairscale_c"], per_round["fairscale"])]
            row["paired_ratio_median"] = statistics.median(paired)
        if unshared:
            paired = [a / b for a, b in zip(per_round["fairscale_c"], per_round[UNSHARED])]
            row["shared_vs_unshared_paired"] = statistics.median(paired)
        rows.append(row)
        theirs_text = f"{theirs:20.1f}" if theirs else f"{'(not installed)':>20}"
        ratio_text = f"{row['ratio']:6.2f} {row['paired_ratio_median']:7.2f}" if theirs else f"{'-':>6} {'-':>7}"
        fault_text = " ".join(f"{row[name]['minor_faults_per_step']:8.0f}" for name in per_round if name != UNSHARED)
        extra = ""
        if unshared:
            extra = f" {row[UNSHARED]['samples_per_s']:19.1f} {row['shared_vs_unshared_paired']:16.2f}"
        print(f"{chunks:>6} {theirs_text} {ours:22.1f} {ratio_text} {fault_text:>38}{extra}", flush=True)
        del trainers
    result: Dict[str, Any] = {"config": asdict(cfg), "torch_threads": torch.get_num_threads(), "rows": rows}
    if fairscale_pipe is not None:
        met = all(r["ratio"] >= 1.0 for r in rows)
        worst = min(rows, key=lambda r: r["ratio"])
        verdict = (
            f"target (>= FairScale's throughput at every chunk count): {'MET' if met else 'NOT MET'}; "
            f"lowest ratio {worst['ratio']:.2f} at chunks={worst['chunks']}"
        )
        result["target_met"] = met
    else:
        verdict = "target (>= FairScale's throughput at every chunk count): not checked, FairScale is not installed"
        result["target_met"] = None
    print(verdict, flush=True)
    result["verdict"] = verdict
    return result


def _guard(trainers: Dict[str, Trainer], x: torch.Tensor, target: torch.Tensor) -> None:
    """The frameworks' first-step loss and gradients agree (both start from the same weights)."""
    seen = []
    for t in trainers.values():
        t.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(t.pipe(x), target)
        loss.backward()
        seen.append((loss.detach(), [p.grad.clone() for p in t.pipe.parameters()]))
        t.opt.zero_grad(set_to_none=True)
    for loss, grads in seen[1:]:
        torch.testing.assert_close(loss, seen[0][0], rtol=1e-4, atol=1e-6)
        for a, b in zip(grads, seen[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def load_average() -> Optional[List[float]]:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode")
    sub.add_parser("multi", help="2 processes, one stage each: see benchmarks/pipe_stages.py --help")
    single = sub.add_parser("single", help="one process, CPU, fairscale_c.nn.Pipe vs FairScale's Pipe (default)")
    d = SingleConfig()
    single.add_argument("--quick", action="store_true", help="small model, chunks 1, 2, 4")
    for field_name, value in asdict(d).items():
        flag = "--" + field_name.replace("_", "-")
        single.add_argument(flag, type=type(value), default=None, help=f"default {value}")
    single.add_argument("--unshared", action="store_true", help="also time fairscale_c without thread sharing")
    single.add_argument("--out", default=RESULTS, help="JSON results path (merged: one key per mode)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("single", "-h", "--help"):
        argv.insert(0, "single")  # the default mode
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    if list(sys.argv[1:] if argv is None else argv)[:1] == ["multi"]:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import pipe_stages

        return pipe_stages.main(list(sys.argv[1:] if argv is None else argv)[1:])
    args = parse_args(argv)
    result: Dict[str, Any] = {}
    if os.path.exists(args.out):
        try:
            with open(args.out) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {}
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
        "load_average_before": load_average(),
    }
    if args.mode == "single":
        cfg = quick_single() if args.quick else SingleConfig()
        for field_name in asdict(cfg):
            value = getattr(args, field_name)
            if value is not None:
                setattr(cfg, field_name, value)
        print(f"single: {asdict(cfg)}; torch {torch.__version__}; {os.cpu_count()} CPU cores", flush=True)
        try:
            out = run_single(cfg, unshared=args.unshared)
        except BaseException:
            # FairScale 0.4.13's Pipe joins its worker threads in __del__, which can block forever
            # at interpreter exit once a step has failed: report and leave without finalizers.
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    else:
        raise SystemExit(f"unknown mode {args.mode!r}")
    meta["load_average_after"] = load_average()
    result[args.mode] = {**meta, **out}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out} (key {args.mode!r}); load average before {meta['load_average_before']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
