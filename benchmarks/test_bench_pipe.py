"""Pipelines on CPU, each paired with what users would compare it with.

- ``test_pipe_step``: one training step (zero_grad, forward, MSE loss, backward, SGD step) of
  fairscale_c.nn.Pipe, single process, 2 CPU partitions, 4 chunks, against FairScale 0.4.13's
  Pipe on the same model (benchmarks/pipe.py's ``quick_single`` model: 4 x (Linear(256, 256),
  ReLU), batch 64, checkpoint "except_last"). Timed in this process with pytest-benchmark's own
  calibration; torch keeps its default threads (the partitions run on worker threads). Guard:
  both frameworks give the same first-step loss and gradients (benchmarks/pipe.py's _guard).
- ``test_pipeline_stages_step``: one training step (zero_grad, ``schedule.step``, SGD step) of a
  2-stage pipeline at world 2, one stage per rank, 4 micro-batches, fairscale_c's PipelineStage
  with ScheduleGPipe / Schedule1F1B against torch.distributed.pipelining (gloo) with the same
  schedule, on benchmarks/pipe_stages.py's ``--quick`` model (2 x 2 x (Linear(128, 128), ReLU),
  batch 48). A round is STEPS_PER_ROUND steps after a barrier, timed as the slowest rank's
  elapsed time / STEPS_PER_ROUND (see _harness.measured_time). Guard: from the same weights, the
  per-micro-batch losses equal torch's with the same schedule (pipe_stages.check_losses).
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from typing import Any, Dict

import pytest
import torch

from _harness import RankState, drive, measured_time, median, time_calls

# single process
PIPE_FRAMEWORKS = ["fairscale", "fairscale_c"]  # FairScale first: fairscale_c's ratio reads its median
PIPE_CHUNKS = 4
# multi-process
STAGE_FRAMEWORKS = ["torch", "fairscale_c"]  # torch first, as above
STAGE_SCHEDULES = ["gpipe", "1f1b"]
MICROBATCHES = 4
STEPS_PER_ROUND, ROUNDS, WARMUP_STEPS = 5, 8, 2
LOSS_ATOL = 1e-6

_medians: Dict[str, float] = {}


# ---------------------------------------------------------------- single process


@pytest.fixture(scope="module")
def single_setup() -> Dict[str, Any]:
    import pipe as pipe_script

    cfg = pipe_script.quick_single()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.batch, cfg.width, generator=g)
    target = torch.randn(cfg.batch, cfg.width, generator=g)
    from fairscale_c.nn import Pipe

    classes: Dict[str, Any] = {"fairscale_c": Pipe}
    theirs = pipe_script.load_fairscale_pipe()
    if theirs is not None:
        classes["fairscale"] = theirs
    trainers = {name: pipe_script.Trainer(cls, cfg, PIPE_CHUNKS) for name, cls in classes.items()}
    pipe_script._guard(trainers, x, target)  # same first-step loss and gradients from the same weights
    return {"cfg": cfg, "x": x, "target": target, "trainers": trainers}


@pytest.mark.benchmark(max_time=1.0, min_rounds=10)
@pytest.mark.parametrize("framework", PIPE_FRAMEWORKS)
def test_pipe_step(benchmark: Any, single_setup: Dict[str, Any], framework: str) -> None:
    trainer = single_setup["trainers"].get(framework)
    if trainer is None:
        pytest.skip("FairScale is not installed (pip install fairscale==0.4.13 --no-deps)")
    cfg, x, target = single_setup["cfg"], single_setup["x"], single_setup["target"]
    benchmark.group = f"pipe step, single process, 2 cpu partitions, {PIPE_CHUNKS} chunks"
    for _ in range(WARMUP_STEPS):
        trainer.step(x, target)
    loss = benchmark(trainer.step, x, target)
    assert torch.isfinite(torch.tensor(loss)), f"{framework}: non-finite loss {loss}"
    key = f"pipe/{framework}"
    _medians[key] = benchmark.stats.stats.median if benchmark.stats is not None else float("nan")
    base = _medians.get("pipe/fairscale")
    benchmark.extra_info.update(
        {
            "framework": framework,
            "model": f"{cfg.layers} x (Linear({cfg.width}, {cfg.width}), ReLU), batch {cfg.batch}",
            "chunks": PIPE_CHUNKS,
            "checkpoint": cfg.checkpoint,
            "step_vs_fairscale": _medians[key] / base if base and framework != "fairscale" else None,
        }
    )


# ---------------------------------------------------------------- multi-process stages


def _stages_config() -> Dict[str, Any]:
    import pipe_stages

    cfg = pipe_stages.quick_config()
    cfg.microbatches = [MICROBATCHES]
    return asdict(cfg)


def _prepare_stages(state: RankState, cfg_dict: Dict[str, Any], framework: str, schedule: str) -> None:
    """Rank command: build every framework's schedules once per module (pipe_stages.rank_setup),
    take the warm-up steps of (framework, schedule), and leave one training step in state.op."""
    import pipe_stages

    if state.case.get("cfg_dict") != cfg_dict:
        state.op = None
        pipe_stages.rank_setup(state, cfg_dict)
        state.case["cfg_dict"] = cfg_dict
    sched = state.case["scheds"][(framework, schedule, MICROBATCHES)]
    for _ in range(WARMUP_STEPS):
        pipe_stages._one_step(state, sched)
    state.op = partial(pipe_stages._one_step, state, sched)


def _losses_match(state: RankState) -> Dict[str, Any]:
    """Rank command: every framework's per-micro-batch losses from the same weights (last stage)."""
    import pipe_stages

    return pipe_stages.check_losses(state, MICROBATCHES)


@pytest.mark.benchmark(timer=measured_time)
@pytest.mark.parametrize("framework", STAGE_FRAMEWORKS)
@pytest.mark.parametrize("schedule", STAGE_SCHEDULES)
def test_pipeline_stages_step(benchmark: Any, ranks: Any, schedule: str, framework: str) -> None:
    cfg = _stages_config()
    benchmark.group = f"pipeline stages step, {schedule}, m={MICROBATCHES}, cpu world 2"
    ranks.run(_prepare_stages, cfg, framework, schedule)
    per_step = drive(benchmark, lambda: max(ranks.run(time_calls, STEPS_PER_ROUND)) / STEPS_PER_ROUND, ROUNDS)
    key = f"stages/{schedule}/{framework}"
    _medians[key] = median(per_step)
    base = _medians.get(f"stages/{schedule}/torch")
    losses = ranks.run(_losses_match)[-1]
    mine, torch_losses = losses[f"{framework}/{schedule}"], losses[f"torch/{schedule}"]
    diff = max(abs(a - b) for a, b in zip(mine, torch_losses))
    benchmark.extra_info.update(
        {
            "framework": framework,
            "schedule": schedule,
            "microbatches": MICROBATCHES,
            "model": {k: cfg[k] for k in ("d", "layers", "batch")},
            "steps_per_round": STEPS_PER_ROUND,
            "timing": "slowest rank's time for steps_per_round back-to-back steps after a barrier, / steps_per_round",
            "step_vs_torch": _medians[key] / base if base and framework != "torch" else None,
            "max_abs_loss_diff_vs_torch": diff,
        }
    )
    assert len(mine) == MICROBATCHES and all(torch.isfinite(torch.tensor(mine))), f"{framework}: losses {mine}"
    assert diff <= LOSS_ATOL, f"{framework}/{schedule}: losses differ from torch's by {diff:.3g}"
