"""One training step of the small GPT (benchmarks/fsdp.py's --quick model) on CPU at world 2:
fairscale_c's FullyShardedDataParallel, with PyTorch's FSDP2 and with no sharding ("local": each
rank trains its own full copy, no communication: the compute floor) as the paired cases.

A step is zero_grad + forward + loss + backward + AdamW step + loss.item(), as in
benchmarks/fsdp.py. The model is built and wrapped in the long-lived rank processes (same seed,
same per-rank batches for every framework) and takes WARMUP_STEPS untimed steps; a round is then
STEPS_PER_ROUND steps back to back after a barrier, and its per-step time is the slowest rank's
elapsed time / STEPS_PER_ROUND (see _harness.measured_time).

Guards, so that a case cannot time a run that does not train: every loss is finite, the loss
falls, and fairscale_c's losses match FSDP2's step for step (both see the same data).

OSS and Pipe steps belong in test_bench_oss.py / test_bench_pipe.py beside this file, on the same
`ranks` fixture, once those features exist (docs/benchmarks.md, "Adding cases").
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, List

import pytest
from conftest import WORLD

from _harness import RankState, case_losses, drive, install_training, measured_time, median, record_training, time_calls

FRAMEWORKS = ["torch_fsdp2", "fairscale_c", "local"]  # FSDP2 first: the others' ratios read its median
STEPS_PER_ROUND, ROUNDS, WARMUP_STEPS = 5, 6, 2
LOSS_MATCH_ATOL = 1e-3

_results: Dict[str, Dict[str, Any]] = {}


def _config() -> Dict[str, Any]:
    import fsdp as fsdp_script  # benchmarks/fsdp.py

    cfg = fsdp_script.quick_config()
    cfg.world, cfg.threads, cfg.warmup = WORLD, 1, WARMUP_STEPS
    cfg.steps = (ROUNDS + 1) * STEPS_PER_ROUND  # the timed rounds and pedantic's warm-up round
    return asdict(cfg)


def _prepare_training(state: RankState, framework: str, cfg_dict: Dict[str, Any]) -> None:
    """Rank command: build and wrap the model for `framework`, take the warm-up steps, and leave
    one training step in state.op."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")

    def build(cfg: Any) -> Any:
        import torch

        import fsdp as fsdp_script

        model = fsdp_script.WRAPPERS[framework](fsdp_script.GPT(cfg), cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

        def step(x: Any, y: Any) -> List[float]:
            opt.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            opt.step()
            return [loss.item()]

        return step

    install_training(state, cfg_dict, build)


@pytest.mark.benchmark(timer=measured_time)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fsdp_step(benchmark: Any, ranks: Any, framework: str) -> None:
    cfg = _config()
    benchmark.group = f"fsdp step, small GPT, cpu world {WORLD}"
    ranks.run(_prepare_training, framework, cfg)
    per_step = drive(benchmark, lambda: max(ranks.run(time_calls, STEPS_PER_ROUND)) / STEPS_PER_ROUND, ROUNDS)
    losses = ranks.run(case_losses)
    info: Dict[str, Any] = {
        "framework": framework,
        "world": WORLD,
        "config": {k: cfg[k] for k in ("layers", "d_model", "heads", "seq", "vocab", "batch", "lr")},
        "steps_per_round": STEPS_PER_ROUND,
        "timing": "slowest rank's time for steps_per_round back-to-back steps after a barrier, / steps_per_round",
        "tokens_per_s": WORLD * cfg["batch"] * cfg["seq"] / median(per_step),
    }
    record_training(
        benchmark, _results, framework, "torch_fsdp2", per_step, losses, info, STEPS_PER_ROUND, LOSS_MATCH_ATOL
    )
