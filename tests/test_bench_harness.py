"""The rank pool and timer of the benchmark suite (benchmarks/_harness.py): a failing or hung rank
ends in an error naming it, never a hang, and the ranks are gone afterwards."""

from __future__ import annotations

import os
import time

import pytest

import _harness
from _harness import RankPool, shm_segments_of


def _whoami(state, x):
    return (state.rank, state.world, x)


def _fail_on_rank1(state):
    import torch

    if state.rank == 1:
        raise ValueError("rank 1 refuses")
    state.group.all_reduce(torch.ones(2))  # its peer never joins: the pool must not wait for it


def _sleep(state, seconds):
    time.sleep(seconds)


def _set_op(state):
    calls = state.case.setdefault("calls", [])
    state.op = lambda: calls.append(1)


def _count(state):
    return len(state.case["calls"])


def _alive(pids):
    return [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _status(p)]


def _status(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except FileNotFoundError:
        return "zombie"


def test_pool_runs_commands_and_reports_a_failing_rank():
    pool = RankPool(2)
    try:
        assert pool.run(_whoami, "x") == [(0, 2, "x"), (1, 2, "x")]
        pool.run(_set_op)
        elapsed = pool.run(_harness.time_calls, 7)
        assert all(isinstance(t, float) and t >= 0 for t in elapsed)
        assert pool.run(_count) == [7, 7]
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?s)_fail_on_rank1 failed.*rank 1.*ValueError: rank 1 refuses"):
            pool.run(_fail_on_rank1)
        assert time.monotonic() - t0 < 30
        assert _alive(pool.pids) == []
        assert shm_segments_of(pool.pids) == []
        with pytest.raises(RuntimeError, match=r"(?s)stopped after an earlier failure.*rank 1 refuses"):
            pool.run(_whoami, 1)
    finally:
        pool.close()
    pool.close()  # idempotent


def test_pool_times_out_a_hung_command_and_stops_cleanly():
    pool = RankPool(2)
    try:
        with pytest.raises(TimeoutError, match=r"_sleep: ranks \[0, 1\] did not answer within 1 s"):
            pool.run(_sleep, 600, timeout=1)
        assert _alive(pool.pids) == []
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_whoami, 1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        RankPool(0)
    for bad in (-1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="advance: seconds"):
            _harness.advance(bad)
    state = _harness.RankState(rank=0, world=1, group=None, op=lambda: None)
    for bad in (0, -3, 2.0):
        with pytest.raises(ValueError, match="time_calls: calls must be an int >= 1"):
            _harness.time_calls(state, bad)
    with pytest.raises(RuntimeError, match="no case was set up"):
        _harness.time_calls(_harness.RankState(rank=0, world=1, group=None), 1)


def test_measured_time_moves_only_by_what_was_measured():
    t0 = _harness.measured_time()
    time.sleep(0.01)
    assert _harness.measured_time() == t0
    _harness.advance(0.25)
    assert _harness.measured_time() == pytest.approx(t0 + 0.25)
