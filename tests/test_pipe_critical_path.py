"""benchmarks/pipe_stages.py's critical path (the step with free messages) on schedules whose
length is known in closed form."""

from __future__ import annotations

from types import SimpleNamespace

import pipe_stages
import pytest

from fairscale_c.nn.pipe import Schedule1F1B, ScheduleGPipe


def orders(cls, p: int, m: int):
    """Every rank's actions as (kind, micro-batch, stage), from the schedule's own order()."""
    out = []
    for r in range(p):
        fake = SimpleNamespace(_n_microbatches=m, _stages=[SimpleNamespace(num_stages=p, stage_index=r)])
        out.append([(a.kind, a.mb, r) for a in cls.order(fake)])
    return out


@pytest.mark.parametrize("cls", [ScheduleGPipe, Schedule1F1B])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 6), (4, 8)])
def test_uniform_stages_take_the_fill_drain_length(cls, p, m):
    f, b, opt = 1.0, 2.0, 0.5
    costs = [{"fwd": f, "bwd": b, "loss": 0.0, "opt": opt}] * p
    # every stage alike: (m + p - 1) forward-backward slots, then the optimizer step
    assert pipe_stages.critical_path(orders(cls, p, m), costs, p) == pytest.approx((m + p - 1) * (f + b) + opt)


def test_a_slower_stage_sets_the_pace():
    # two stages, the second's backward 3x the first's: after the first forward, the second
    # stage computes without a break, then the first stage's last backward
    costs = [{"fwd": 1.0, "bwd": 1.0, "loss": 0.0, "opt": 0.0}, {"fwd": 1.0, "bwd": 3.0, "loss": 0.5, "opt": 0.0}]
    m = 4
    want = 1.0 + m * (1.0 + 0.5 + 3.0) + 1.0
    assert pipe_stages.critical_path(orders(ScheduleGPipe, 2, m), costs, 2) == pytest.approx(want)
    assert pipe_stages.critical_path(orders(Schedule1F1B, 2, m), costs, 2) == pytest.approx(want)


def test_orders_that_wait_on_each_other_are_refused():
    costs = [{"fwd": 1.0, "bwd": 1.0, "loss": 0.0, "opt": 0.0}] * 2
    # stage 0 starts with a backward: it waits for stage 1's, which waits for stage 0's forward
    stuck = [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 1), ("B", 0, 1)]]
    with pytest.raises(RuntimeError, match="wait on each other"):
        pipe_stages.critical_path(stuck, costs, 2)


def _row(fw: str, name: str, m: int, step_s: float, path: float = 0.0) -> dict:
    row = {
        "framework": fw,
        "schedule": name,
        "microbatches": m,
        "step_s": step_s,
        "step_s_rounds": [step_s] * 3,
        "samples_per_s": 48 / step_s,
        "peak_activation_bytes_per_stage": [2**20, 2**19],
        "bubble_per_stage": [0.3, 0.2],
        "bubble_ideal": 0.2,
    }
    if path:
        row["critical_path_s"] = path
    return row


@pytest.mark.parametrize("with_path", [True, False])
def test_report_puts_the_critical_path_beside_both_frameworks(with_path):
    cfg = pipe_stages.Config(microbatches=[4])
    path = 0.030 if with_path else 0.0
    rows = [
        _row(fw, name, 4, {"fairscale_c": 0.033, "torch": 0.036}[fw], path)
        for name in pipe_stages.SCHEDULES
        for fw in pipe_stages.FRAMEWORKS
    ]
    lines = pipe_stages.report({"rows": rows}, cfg)
    gpipe = next(ln for ln in lines if ln.startswith("| gpipe | 4 |"))
    verdict = next(ln for ln in lines if ln.startswith("MISSED throughput gpipe m=4"))  # 0.036 / 0.033 = 1.09
    if with_path:
        assert gpipe.endswith("| 30.0 | 1.100 | 1.200 |")
        assert "with free messages at most 1.20x" in verdict and "ours is 1.10x the path" in verdict
    else:  # results saved before the path was measured
        assert gpipe.endswith("| – | – | – |")
        assert "free messages" not in verdict
