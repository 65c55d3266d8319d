"""SlowMo benchmark: fairscale_c's SlowMoDistributedDataParallel at world 2 on CPU ranks, beside the
compute floor, torch's DistributedDataParallel (gloo) and FairScale 0.4.13's SlowMo, in the same run.

    PYTHONPATH=. python benchmarks/slowmo.py          # three model sizes
    PYTHONPATH=. python benchmarks/slowmo.py --quick  # two small sizes, 2 rounds

The model: an MLP of `depth` Linear(width, width) + ReLU layers on a (batch, width) input per rank.
A training step: forward, loss = mean(y^2), backward, SGD step, then the framework's averaging.

Columns (frameworks):
- floor: the plain model, no communication.
- ddp: torch.nn.parallel.DistributedDataParallel on gloo (gradients all-reduced every step).
- localsgd1 / localsgd3: ours, LocalSGD averaging the parameters every step / every 3rd step
  (slow momentum off). localsgd1 moves what DDP moves, once per step.
- sgp: ours, stochastic gradient push (each step a parameter exchange with one peer).
- slowmo1: ours, the slow momentum step every step, memory-efficient (parameters averaged into
  their shard owner and sent back: a reduce-scatter and an all-gather), LocalSGD off.
- fs_slowmo1: FairScale's SlowMo in the same setting (one reduce and one broadcast per shard
  through torch.distributed on gloo). It is the only FairScale SlowMo setting that runs on CPU
  ranks: its LocalSGD and SGP paths call torch.cuda.synchronize. Skipped, and said so, without
  fairscale.

"own" = step - floor. Timing alternates between the frameworks round by round (the order flips
every round, a barrier before each); each number is the median over rounds of the slower rank's
mean step (6 steps a round by default, so localsgd3 averages twice a round). Peak memory: the rise
of a rank's resident high-water mark over its resident size before one step, the larger rank's,
in processes of their own (benchmarks/_ranks.py). Before timing, slowmo1 and fs_slowmo1 are
checked to give the same parameters after two steps.

Results go to stdout (a table) and benchmarks/results/slowmo.json.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import bench_main, max_over_ranks, parse_triples, peak_rise_mib, time_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "slowmo.json"
WORLD = 2
SIZES = [(512, 4, 32), (1024, 4, 32), (2048, 4, 32)]  # (width, depth, batch per rank)
QUICK = [(64, 2, 8), (256, 2, 8)]
OURS = ["localsgd1", "localsgd3", "sgp", "slowmo1"]


def load_fairscale_slowmo() -> Optional[Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fairscale.experimental.nn import data_parallel
    except ImportError:
        return None
    if "fairscale_c" in getattr(data_parallel, "__file__", ""):  # the alias, not FairScale
        return None
    return data_parallel.SlowMoDistributedDataParallel


def _settings(framework: str) -> Dict[str, Any]:
    never = 10**9
    return {
        "localsgd1": dict(localsgd_frequency=1, slowmo_momentum=0.0),
        "localsgd3": dict(localsgd_frequency=3, slowmo_momentum=0.0),
        "sgp": dict(slowmo_base_algorithm="sgp", slowmo_momentum=0.0),
        "slowmo1": dict(localsgd_frequency=never, slowmo_frequency=1, slowmo_momentum=0.5),
        "fs_slowmo1": dict(localsgd_frequency=never, slowmo_frequency=1, slowmo_momentum=0.5),
    }[framework]


class Model:
    """One framework's MLP on this rank, its optimizer and its step."""

    def __init__(self, framework: str, width: int, depth: int, batch: int, rank: int) -> None:
        import torch.distributed as dist

        torch.manual_seed(1)
        layers: List[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers)
        self.slowmo = framework not in ("floor", "ddp")
        if framework == "ddp":
            self.net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(net)
            params = self.net.parameters()
        elif framework == "fs_slowmo1":
            cls = load_fairscale_slowmo()
            self.net = cls(net, nprocs_per_node=1, global_group=dist.group.WORLD, **_settings(framework))
            params = self.net.module.parameters()
        elif self.slowmo:
            from fairscale_c.experimental.nn.data_parallel import SlowMoDistributedDataParallel

            self.net = SlowMoDistributedDataParallel(net, nprocs_per_node=1, **_settings(framework))
            params = self.net.module.parameters()
        else:
            self.net = net
            params = net.parameters()
        self.opt = torch.optim.SGD(params, lr=1e-3)
        self.x = torch.randn(batch, width, generator=torch.Generator().manual_seed(10 + rank))

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.net(self.x).pow(2).mean().backward()
        self.opt.step()
        if self.slowmo:
            self.net.perform_slowmo(self.opt)


def _guard(width: int, depth: int, batch: int, rank: int, key: str) -> None:
    """Two steps of slowmo1 and fs_slowmo1 from the same start give the same parameters."""
    models = [Model(f, width, depth, batch, rank) for f in ("slowmo1", "fs_slowmo1")]
    for _ in range(2):
        for m in models:
            m.step()
    for a, b in zip(*(m.net.module.parameters() for m in models)):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"fairscale_c's and FairScale's SlowMo differ at {key}")


def rank_main(rank: int, cfg: Dict[str, Any], mode: str) -> Dict[str, Any]:
    frameworks = ["floor", "ddp"] + OURS + (["fs_slowmo1"] if load_fairscale_slowmo() is not None else [])
    results: Dict[str, Any] = {}
    for width, depth, batch in cfg["sizes"]:
        key = f"{depth}x{width} b{batch}"
        models = {f: Model(f, width, depth, batch, rank) for f in frameworks}
        if mode == "memory":
            results[key] = {}
            for f, model in models.items():
                model.step()  # warm-up
                results[key][f] = {"peak_mib": max_over_ranks(peak_rise_mib(model.step))}
            continue
        if "fs_slowmo1" in models:
            _guard(width, depth, batch, rank, key)
        steps: Dict[str, Callable[[], None]] = {f: m.step for f, m in models.items()}
        results[key] = time_steps(steps, cfg)
        params = sum(p.numel() for p in models["floor"].net.parameters())
        results[key]["floor"]["params_m"] = params / 1e6
    return results


def _cell(r: Dict[str, Any], f: str, floor: float) -> str:
    if f not in r:
        return "not installed"
    step = r[f]["step_s"]
    return f"{1e3 * step:.2f} ({1e3 * (step - floor):+.2f})"


def table(results: Dict[str, Any]) -> str:
    cols = ["ddp"] + OURS + ["fs_slowmo1"]
    lines = [
        "| model (params) | floor ms | " + " | ".join(f"{c} ms (own)" for c in cols) + " | "
        "own: localsgd1 / ddp | own: slowmo1 / FS slowmo1 | peak MiB: floor / ddp / localsgd1 / slowmo1 / FS |",
        "|---" * (len(cols) + 5) + "|",
    ]
    for key, r in results.items():
        floor = r["floor"]["step_s"]
        own = {f: r[f]["step_s"] - floor for f in cols if f in r}
        ddp_ratio = f"{own['localsgd1'] / own['ddp']:.2f}" if own["ddp"] > 0 else "-"
        fs_ratio = f"{own['slowmo1'] / own['fs_slowmo1']:.2f}" if own.get("fs_slowmo1", 0) > 0 else "-"
        peaks = " / ".join(
            f"{r[f]['peak_mib']:.1f}" if f in r else "-" for f in ("floor", "ddp", "localsgd1", "slowmo1", "fs_slowmo1")
        )
        lines.append(
            f"| {key} ({r['floor']['params_m']:.2f} M) | {1e3 * floor:.2f} | "
            + " | ".join(_cell(r, f, floor) for f in cols)
            + f" | {ddp_ratio} | {fs_ratio} | {peaks} |"
        )
    return "\n".join(lines)


def parse_sizes(text: str) -> List[Tuple[int, int, int]]:
    return parse_triples(text, "1024x4x32")


def main(argv: Optional[List[str]] = None) -> int:
    return bench_main(
        __doc__,
        argv,
        sizes_flag="--sizes",
        sizes_help="comma-separated WIDTHxDEPTHxBATCH, e.g. 1024x4x32",
        parse_sizes=parse_sizes,
        sizes=SIZES,
        quick=QUICK,
        rank_main=rank_main,
        world=WORLD,
        table=table,
        results_path=str(RESULTS),
        peer_installed=load_fairscale_slowmo() is not None,
        default_steps=6,
        full_rounds=7,
    )


if __name__ == "__main__":
    sys.exit(main())
