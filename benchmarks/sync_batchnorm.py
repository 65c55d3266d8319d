"""SyncBatchNorm benchmark: fairscale_c.experimental.nn.SyncBatchNorm against FairScale 0.4.13's, at
world 2 on CPU ranks, in the same run, beside the compute floor.

    PYTHONPATH=. python benchmarks/sync_batchnorm.py          # three sizes
    PYTHONPATH=. python benchmarks/sync_batchnorm.py --quick  # two small sizes, 2 rounds

The model: two blocks of Conv2d(C, C, 3, padding=1) -> BatchNorm -> ReLU on an (N, C, H, H) batch
per rank. A training step: forward, loss = mean(y^2), backward, SGD step.

- fairscale_c: the BatchNorms are fairscale_c's SyncBatchNorm (one all_gather of 2C + 1 values in
  forward and one all_reduce of 2C in backward per layer, on the shared-memory engine).
- fairscale: FairScale 0.4.13's SyncBatchNorm (two all_reduces forward, one backward per layer,
  through torch.distributed on gloo). Skipped, and said so, without fairscale.
- floor: torch's BatchNorm2d with each rank's own statistics (no communication).
(torch.nn.SyncBatchNorm takes CUDA tensors only, so it has no CPU row.)

"own" = step - floor. Timing alternates between the frameworks round by round (the order flips
every round, a barrier before each); each number is the median over rounds of the slower rank's
mean step. Peak memory: the rise of a rank's resident high-water mark over its resident size
before one step, the larger rank's, measured in processes of their own (benchmarks/_ranks.py).
Before timing, the two SyncBatchNorm models' outputs are compared (same weights, same batch).

Results go to stdout (a table) and benchmarks/results/sync_batchnorm.json.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import bench_main, parse_triples, max_over_ranks, peak_rise_mib, time_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "sync_batchnorm.json"
WORLD = 2
SIZES = [(16, 8, 16), (32, 16, 16), (64, 16, 32)]  # (channels C, batch N per rank, height H = width)
QUICK = [(8, 4, 8), (16, 8, 16)]


def load_fairscale_sync_bn() -> Optional[Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fairscale.experimental.nn import sync_batchnorm
    except ImportError:
        return None
    if "fairscale_c" in getattr(sync_batchnorm, "__file__", ""):  # the alias, not FairScale
        return None
    return sync_batchnorm.SyncBatchNorm


class Model:
    """One framework's conv/BatchNorm stack on this rank, its optimizer and its step."""

    def __init__(self, framework: str, c: int, n: int, h: int, rank: int) -> None:
        from fairscale_c.experimental.nn import SyncBatchNorm

        norm = {"fairscale_c": SyncBatchNorm, "floor": torch.nn.BatchNorm2d, "fairscale": load_fairscale_sync_bn()}
        torch.manual_seed(1)
        layers: List[torch.nn.Module] = []
        for _ in range(2):
            layers += [torch.nn.Conv2d(c, c, 3, padding=1), norm[framework](c), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-3)
        self.x = torch.randn(n, c, h, h, generator=torch.Generator().manual_seed(10 + rank))

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.net(self.x).pow(2).mean().backward()
        self.opt.step()


def _guard(models: Dict[str, Model], key: str) -> None:
    """fairscale_c's and FairScale's models give the same outputs and first-layer gradients."""
    got: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for f in ("fairscale_c", "fairscale"):
        y = models[f].net(models[f].x)
        y.pow(2).mean().backward()
        got.append((y.detach(), models[f].net[0].weight.grad.clone()))
        models[f].opt.zero_grad(set_to_none=True)
    (a, ga), (b, gb) = got
    if not (torch.allclose(a, b, rtol=1e-4, atol=1e-5) and torch.allclose(ga, gb, rtol=1e-3, atol=1e-6)):
        raise RuntimeError(f"fairscale_c and FairScale SyncBatchNorm models differ at {key}")


def rank_main(rank: int, cfg: Dict[str, Any], mode: str) -> Dict[str, Any]:
    frameworks = ["fairscale_c", "floor"] + (["fairscale"] if load_fairscale_sync_bn() is not None else [])
    results: Dict[str, Any] = {}
    for c, n, h in cfg["sizes"]:
        key = f"C{c} N{n} {h}x{h}"
        models = {f: Model(f, c, n, h, rank) for f in frameworks}
        if mode == "memory":
            results[key] = {}
            for f, model in models.items():
                model.step()  # warm-up
                results[key][f] = {"peak_mib": max_over_ranks(peak_rise_mib(model.step))}
            continue
        if "fairscale" in models:
            _guard(models, key)
        steps: Dict[str, Callable[[], None]] = {f: m.step for f, m in models.items()}
        results[key] = time_steps(steps, cfg)
    return results


def table(results: Dict[str, Any]) -> str:
    lines = [
        "| size per rank | floor ms | fairscale_c ms | FairScale ms | step ratio (ours/FS) | ours / floor | "
        "own ms ours / FS | own ratio | peak MiB floor / ours / FS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        floor, ours, fs = r["floor"], r["fairscale_c"], r.get("fairscale")
        own = ours["step_s"] - floor["step_s"]
        over = ours["step_s"] / floor["step_s"]
        if fs is None:
            lines.append(
                f"| {key} | {1e3 * floor['step_s']:.2f} | {1e3 * ours['step_s']:.2f} | not installed | - | "
                f"{over:.3f} | {1e3 * own:.2f} / - | - | {floor['peak_mib']:.1f} / {ours['peak_mib']:.1f} / - |"
            )
            continue
        fs_own = fs["step_s"] - floor["step_s"]
        own_ratio = f"{own / fs_own:.2f}" if fs_own > 0 else "-"
        lines.append(
            f"| {key} | {1e3 * floor['step_s']:.2f} | {1e3 * ours['step_s']:.2f} | {1e3 * fs['step_s']:.2f} | "
            f"{ours['step_s'] / fs['step_s']:.2f} | {over:.3f} | {1e3 * own:.2f} / {1e3 * fs_own:.2f} | {own_ratio} | "
            f"{floor['peak_mib']:.1f} / {ours['peak_mib']:.1f} / {fs['peak_mib']:.1f} |"
        )
    return "\n".join(lines)


def parse_sizes(text: str) -> List[Tuple[int, int, int]]:
    return parse_triples(text, "32x16x16")


def main(argv: Optional[List[str]] = None) -> int:
    return bench_main(
        __doc__,
        argv,
        sizes_flag="--sizes",
        sizes_help="comma-separated CxNxH, e.g. 32x16x16",
        parse_sizes=parse_sizes,
        sizes=SIZES,
        quick=QUICK,
        rank_main=rank_main,
        world=WORLD,
        table=table,
        results_path=str(RESULTS),
        peer_installed=load_fairscale_sync_bn() is not None,
        default_steps=5,
        full_rounds=7,
    )


if __name__ == "__main__":
    sys.exit(main())
