"""MEVO benchmark: fairscale_c.experimental.nn.MEVO against FairScale 0.4.13's MEVO and against the
unfused output layer, in one CPU process, in the same run.

    PYTHONPATH=. python benchmarks/mevo.py          # three sizes
    PYTHONPATH=. python benchmarks/mevo.py --quick  # two small sizes, 2 rounds

A step: the summed cross-entropy of (tokens x d) features against a (vocabulary x d) output
weight, forward and backward (input and weight gradients), tile_factor 16 for both MEVOs.

- fairscale_c: MEVO (one pass over the tiles forward, one backward: the logits computed twice).
- fairscale: FairScale's MEVO (max, sum and target passes forward, max and sum recomputed in
  backward). Skipped, and said so, without fairscale.
- unfused: ``cross_entropy(x @ w.T, target, reduction="sum")``: the full logits and their
  gradient in memory; what MEVO replaces.

Timing alternates between them round by round (benchmarks/_ranks.py); each number is the median
over rounds of the mean step. Peak memory: the rise of the resident high-water mark over the
resident size before one step, in a process of its own. Before timing, the three losses and
weight gradients are compared.

Results go to stdout (a table) and benchmarks/results/mevo.json.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import bench_main, parse_triples, peak_rise_mib, time_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "mevo.json"
SIZES = [(512, 256, 8192), (1024, 256, 16384), (1024, 512, 32768)]  # (tokens, d_model, vocabulary)
QUICK = [(64, 32, 1024), (128, 64, 4096)]


def load_fairscale_mevo() -> Optional[Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fairscale.experimental.nn import mevo
    except ImportError:
        return None
    if "fairscale_c" in getattr(mevo, "__file__", ""):  # the alias, not FairScale
        return None
    return mevo.MemoryEfficientVocabOutput


class Case:
    """One framework's output layer, its data and its step."""

    def __init__(self, framework: str, tokens: int, d: int, vocab: int) -> None:
        from fairscale_c.experimental.nn import MEVO

        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(tokens, d, generator=g).requires_grad_()
        self.w = torch.nn.Parameter(torch.randn(vocab, d, generator=g) / d**0.5)
        self.target = torch.randint(0, vocab, (tokens,), generator=g)
        self.framework = framework
        if framework == "fairscale_c":
            self.layer: Optional[torch.nn.Module] = MEVO(self.w, tile_factor=16)
        elif framework == "fairscale":
            self.layer = load_fairscale_mevo()(self.w, tile_factor=16)
        else:
            self.layer = None

    def loss(self) -> torch.Tensor:
        if self.layer is None:
            return F.cross_entropy(self.x @ self.w.T, self.target, reduction="sum")
        return self.layer(self.x, self.target)

    def step(self) -> None:
        self.x.grad = self.w.grad = None
        self.loss().backward()


def _guard(cases: Dict[str, Case], key: str) -> None:
    got = {}
    for f, c in cases.items():
        c.step()
        got[f] = (c.loss().item(), c.w.grad.clone())
    ref_loss, ref_grad = got["unfused"]
    for f, (loss, grad) in got.items():
        if abs(loss - ref_loss) > 1e-4 * abs(ref_loss) or not torch.allclose(grad, ref_grad, rtol=1e-3, atol=1e-4):
            raise RuntimeError(f"{f}'s loss or weight gradient differs from the unfused layer's at {key}")


def rank_main(rank: int, cfg: Dict[str, Any], mode: str) -> Dict[str, Any]:
    frameworks = ["fairscale_c", "unfused"] + (["fairscale"] if load_fairscale_mevo() is not None else [])
    results: Dict[str, Any] = {}
    for tokens, d, vocab in cfg["sizes"]:
        key = f"{tokens} x {d} -> {vocab}"
        cases = {f: Case(f, tokens, d, vocab) for f in frameworks}
        if mode == "memory":
            results[key] = {}
            for f, case in cases.items():
                case.step()  # warm-up
                case.x.grad = case.w.grad = None
                results[key][f] = {"peak_mib": peak_rise_mib(case.step)}
            continue
        _guard(cases, key)
        steps: Dict[str, Callable[[], None]] = {f: c.step for f, c in cases.items()}
        results[key] = time_steps(steps, cfg)
    return results


def table(results: Dict[str, Any]) -> str:
    lines = [
        "| tokens x d -> vocabulary | unfused ms | fairscale_c ms | FairScale ms | ours / unfused | ours / FairScale | "
        "peak MiB unfused / ours / FairScale | peak ours / unfused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        base, ours, fs = r["unfused"], r["fairscale_c"], r.get("fairscale")
        fs_ms = f"{1e3 * fs['step_s']:.1f}" if fs else "not installed"
        fs_ratio = f"{ours['step_s'] / fs['step_s']:.2f}" if fs else "-"
        fs_peak = f"{fs['peak_mib']:.1f}" if fs else "-"
        peak_ratio = f"{ours['peak_mib'] / base['peak_mib']:.3f}" if base["peak_mib"] > 0 else "-"
        lines.append(
            f"| {key} | {1e3 * base['step_s']:.1f} | {1e3 * ours['step_s']:.1f} | {fs_ms} | "
            f"{ours['step_s'] / base['step_s']:.2f} | {fs_ratio} | {base['peak_mib']:.1f} / {ours['peak_mib']:.1f} / "
            f"{fs_peak} | {peak_ratio} |"
        )
    return "\n".join(lines)


def parse_sizes(text: str) -> List[Tuple[int, int, int]]:
    return parse_triples(text, "512x256x8192")


def main(argv: Optional[List[str]] = None) -> int:
    return bench_main(
        __doc__,
        argv,
        sizes_flag="--sizes",
        sizes_help="comma-separated TOKENSxDxVOCAB, e.g. 512x256x8192",
        parse_sizes=parse_sizes,
        sizes=SIZES,
        quick=QUICK,
        rank_main=rank_main,
        world=1,
        table=table,
        results_path=str(RESULTS),
        peer_installed=load_fairscale_mevo() is not None,
        default_steps=2,
        full_rounds=5,
    )


if __name__ == "__main__":
    sys.exit(main())
