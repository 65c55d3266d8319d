"""One training step of the small GPT (benchmarks/fsdp.py's --quick model) with AdamW on CPU at
world 2: fairscale_c's OSS + ShardedDataParallel, paired with PyTorch's ZeroRedundancyOptimizer +
DDP and with no sharding ("local": each rank trains its own full copy, no communication: the
compute floor). The models and optimizers are benchmarks/oss.py's.

A step is zero_grad + forward + loss + backward + optimizer step + loss.item(), as in
benchmarks/oss.py; a round is STEPS_PER_ROUND steps back to back after a barrier, and its per-step
time is the slowest rank's elapsed time / STEPS_PER_ROUND (see _harness.measured_time).

Guards: every loss is finite, the loss falls, and fairscale_c's losses match ZeRO's step for step
(both train the same global batch).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict

import pytest
from conftest import WORLD

from _harness import RankState, case_losses, drive, install_training, measured_time, record_training, time_calls

FRAMEWORKS = ["torch_zero", "fairscale_c", "local"]  # ZeRO first: the others' ratios read its median
STEPS_PER_ROUND, ROUNDS, WARMUP_STEPS = 5, 6, 2
LOSS_MATCH_ATOL = 1e-3

_results: Dict[str, Dict[str, Any]] = {}


def _config() -> Dict[str, Any]:
    import fsdp as fsdp_script

    cfg = fsdp_script.quick_config()
    cfg.world, cfg.threads, cfg.warmup = WORLD, 1, WARMUP_STEPS
    return asdict(cfg)


def _prepare_training(state: RankState, framework: str, cfg_dict: Dict[str, Any]) -> None:
    """Rank command: build the model and optimizer for `framework` (benchmarks/oss.py's builders),
    take the warm-up steps, and leave one training step in state.op."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")

    def build(cfg: Any) -> Any:
        import fsdp as fsdp_script
        import oss as oss_script

        model, opt = oss_script.BUILDERS[framework](fsdp_script.GPT(cfg), cfg)
        return lambda x, y: oss_script.train(model, opt, [(x, y)], framework)[2]

    install_training(state, cfg_dict, build)


@pytest.mark.benchmark(timer=measured_time)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_oss_step(benchmark: Any, ranks: Any, framework: str) -> None:
    import oss as oss_script

    why = oss_script.unavailable(framework)
    if why is not None:
        pytest.skip(why)
    cfg = _config()
    benchmark.group = f"oss step, small GPT, AdamW, cpu world {WORLD}"
    ranks.run(_prepare_training, framework, cfg)
    per_step = drive(benchmark, lambda: max(ranks.run(time_calls, STEPS_PER_ROUND)) / STEPS_PER_ROUND, ROUNDS)
    losses = ranks.run(case_losses)
    info: Dict[str, Any] = {
        "framework": framework,
        "world": WORLD,
        "config": {k: cfg[k] for k in ("layers", "d_model", "heads", "seq", "vocab", "batch", "lr")},
        "steps_per_round": STEPS_PER_ROUND,
        "timing": "slowest rank's time for steps_per_round back-to-back steps after a barrier, / steps_per_round",
    }
    record_training(
        benchmark, _results, framework, "torch_zero", per_step, losses, info, STEPS_PER_ROUND, LOSS_MATCH_ATOL
    )
