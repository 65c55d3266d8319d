"""Tensor model parallelism benchmark: fairscale_c.nn.model_parallel against FairScale 0.4.13's,
at world 2 (model-parallel size 2) on CPU ranks, in the same run, beside the compute floor.

    PYTHONPATH=. python benchmarks/model_parallel.py          # four sizes
    PYTHONPATH=. python benchmarks/model_parallel.py --quick  # two small sizes, 2 rounds

The block is Megatron's MLP: ColumnParallelLinear(d, 4d, gather_output=False) -> GeLU ->
RowParallelLinear(4d, d, input_is_parallel=True), each rank holding half of both weights, both
ranks given the same T tokens of width d. A training step: forward, loss = mean(y^2), backward, SGD
step: one all-reduce of (T, d) float32 forward (the row layer's sum) and one backward (the column
layer's input gradient).

- fairscale_c: its layers, the all-reduces on the shared-memory engine.
- fairscale: FairScale 0.4.13's layers, the all-reduces through torch.distributed on gloo. Skipped,
  and said so, without fairscale.
- floor: the same rank's arithmetic with plain F.linear on its halves of the weights and no
  communication (the partial sums are not added up).

"own" = step - floor. Timing alternates between the frameworks round by round (the order flips
every round, a barrier before each); each number is the median over rounds of the slower rank's
mean step. Peak memory: the rise of a rank's resident high-water mark over its resident size
before one step, the larger rank's, measured in processes of their own (benchmarks/_ranks.py).
Before timing, the two layers' outputs and input gradients are compared (same seeds, same weights).

Results go to stdout (a table) and benchmarks/results/model_parallel.json.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import bench_main, max_over_ranks, peak_rise_mib, time_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "model_parallel.json"
WORLD = 2
SIZES = [(256, 128), (512, 256), (512, 1024), (1024, 512)]  # (width d, tokens T)
QUICK = [(128, 64), (256, 128)]


def load_fairscale_mpu() -> Optional[Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fairscale.nn.model_parallel as fairscale_mpu
    except ImportError:
        return None
    if "fairscale_c" in getattr(fairscale_mpu, "__file__", ""):  # the alias, not FairScale
        return None
    return fairscale_mpu


class Block:
    """One framework's MLP block on this rank, its optimizer and its step."""

    def __init__(self, framework: str, d: int, tokens: int) -> None:
        import fairscale_c.nn.model_parallel as ours

        mpu = ours if framework in ("fairscale_c", "floor") else load_fairscale_mpu()
        torch.manual_seed(1)
        self.up = mpu.ColumnParallelLinear(d, 4 * d, gather_output=False)
        torch.manual_seed(2)
        self.down = mpu.RowParallelLinear(4 * d, d, input_is_parallel=True)
        self.floor = framework == "floor"
        self.opt = torch.optim.SGD(list(self.up.parameters()) + list(self.down.parameters()), lr=1e-3)
        self.x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.floor:
            h = F.gelu(F.linear(x, self.up.weight, self.up.bias))
            return F.linear(h, self.down.weight) + self.down.bias
        return self.down(F.gelu(self.up(x)))

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.forward(self.x).pow(2).mean().backward()
        self.opt.step()


def _guard(blocks: Dict[str, Block], d: int, tokens: int) -> None:
    """fairscale_c's and FairScale's blocks give the same outputs and input gradients."""
    got: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for f in ("fairscale_c", "fairscale"):
        x = blocks[f].x.clone().requires_grad_()
        y = blocks[f].forward(x)
        y.pow(2).mean().backward()
        got.append((y.detach(), x.grad))
        blocks[f].opt.zero_grad(set_to_none=True)
    (a, ga), (b, gb) = got
    if not (torch.allclose(a, b, rtol=1e-5, atol=1e-6) and torch.allclose(ga, gb, rtol=1e-5, atol=1e-7)):
        raise RuntimeError(f"fairscale_c and FairScale blocks differ at d={d}, T={tokens}")


def rank_main(rank: int, cfg: Dict[str, Any], mode: str) -> Dict[str, Any]:
    import fairscale_c.nn.model_parallel as ours

    theirs = load_fairscale_mpu()
    ours.initialize_model_parallel(WORLD)
    if theirs is not None:
        theirs.initialize_model_parallel(WORLD)
    frameworks = ["fairscale_c", "floor"] + (["fairscale"] if theirs is not None else [])
    results: Dict[str, Any] = {}
    for d, tokens in cfg["sizes"]:
        key = f"{d}x{tokens}"
        blocks = {f: Block(f, d, tokens) for f in frameworks}
        if mode == "memory":
            results[key] = {}
            for f, block in blocks.items():
                block.step()  # warm-up
                results[key][f] = {"peak_mib": max_over_ranks(peak_rise_mib(block.step))}
            continue
        if theirs is not None:
            _guard(blocks, d, tokens)
        steps: Dict[str, Callable[[], None]] = {f: b.step for f, b in blocks.items()}
        results[key] = time_steps(steps, cfg)
    return results


def table(results: Dict[str, Any]) -> str:
    lines = [
        "| d x T | floor ms | fairscale_c ms | FairScale ms | step ratio (ours/FS) | own ms ours / FS | own ratio | "
        "peak MiB floor / ours / FS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        floor, ours, fs = r["floor"], r["fairscale_c"], r.get("fairscale")
        own = ours["step_s"] - floor["step_s"]
        if fs is None:
            lines.append(
                f"| {key} | {1e3 * floor['step_s']:.2f} | {1e3 * ours['step_s']:.2f} | not installed | - | "
                f"{1e3 * own:.2f} / - | - | {floor['peak_mib']:.1f} / {ours['peak_mib']:.1f} / - |"
            )
            continue
        fs_own = fs["step_s"] - floor["step_s"]
        own_ratio = f"{own / fs_own:.2f}" if fs_own > 0 else "-"
        lines.append(
            f"| {key} | {1e3 * floor['step_s']:.2f} | {1e3 * ours['step_s']:.2f} | {1e3 * fs['step_s']:.2f} | "
            f"{ours['step_s'] / fs['step_s']:.2f} | {1e3 * own:.2f} / {1e3 * fs_own:.2f} | {own_ratio} | "
            f"{floor['peak_mib']:.1f} / {ours['peak_mib']:.1f} / {fs['peak_mib']:.1f} |"
        )
    return "\n".join(lines)


def parse_sizes(text: str) -> List[Tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        d, _, t = item.partition("x")
        if not (d.isdigit() and t.isdigit()) or int(d) % 2 or int(t) < 1:
            raise argparse.ArgumentTypeError(f"expected DxT pairs with an even d, e.g. 512x256, got {item!r}")
        sizes.append((int(d), int(t)))
    return sizes


def main(argv: Optional[List[str]] = None) -> int:
    return bench_main(
        __doc__,
        argv,
        sizes_flag="--sizes",
        sizes_help="comma-separated DxT, e.g. 512x256,1024x512",
        parse_sizes=parse_sizes,
        sizes=SIZES,
        quick=QUICK,
        rank_main=rank_main,
        world=WORLD,
        table=table,
        results_path=str(RESULTS),
        peer_installed=load_fairscale_mpu() is not None,
    )


if __name__ == "__main__":
    sys.exit(main())
