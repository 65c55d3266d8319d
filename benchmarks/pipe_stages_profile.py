"""Where a pipeline step's time goes: fairscale_c's GPipe / 1F1B on 2 CPU ranks (the default model
of benchmarks/pipe_stages.py), against the schedule's critical path and torch.distributed.pipelining.

    PYTHONPATH=. python benchmarks/pipe_stages_profile.py                       # gpipe m=4, 1f1b m=4 and 8
    PYTHONPATH=. python benchmarks/pipe_stages_profile.py --runs gpipe:8 1f1b:16

Per rank and configuration (medians over the timed steps): the step (zero_grad + schedule.step +
optimizer.step), split into forward, backward and loss compute, waiting in synchronous batches,
issuing asynchronous ones, building the messages, and the rest (the Python of the schedule and
the optimizer). "floor" is the step's critical path from the measured compute alone, no cost for
messages: the first stage's first forward, the whole compute of the last stage, and the first
stage's last backward (with two stages, the last stage's work lies between those two in both
schedules). The ratio torch / floor bounds what any framework could show against torch on this
row: with a framework whose messages cost nothing, the step would still be the floor.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dist_utils import run_ranks  # noqa: E402


class _Timed:
    """Accumulates the wall time of calls to ``fn`` under ``name``."""

    def __init__(self, acc: Dict[str, float], name: str, fn: Any) -> None:
        self.acc, self.name, self.fn = acc, name, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.acc[self.name] += time.perf_counter() - t


class _Logged:
    """Logs (kind, micro-batch, seconds) of each call to a stage's forward_one / backward_one."""

    def __init__(self, log: List[tuple], kind: str, fn: Any) -> None:
        self.log, self.kind, self.fn = log, kind, fn

    def __call__(self, mb: int, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(mb, *args, **kwargs)
        finally:
            self.log.append((self.kind, mb, time.perf_counter() - t))


class _GroupProxy:
    """The stage's group, with its point-to-point batches timed."""

    def __init__(self, group: Any, acc: Dict[str, float], log: List[tuple]) -> None:
        self._group, self._acc, self._log = group, acc, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def batch(self, ops: list, async_op: bool = False) -> Any:
        t = time.perf_counter()
        try:
            return self._group.batch(ops, async_op=async_op)
        finally:
            self._acc["async issue" if async_op else "sync wait"] += time.perf_counter() - t


def _job(rank: int, world: int, runs: List[tuple], d: int, layers: int, batch: int, steps: int) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining as tpp

    from fairscale_c.nn import pipe as fpp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    full: List[torch.nn.Module] = []
    for _ in range(world * layers):
        full += [torch.nn.Linear(d, d), torch.nn.ReLU()]
    mod = torch.nn.Sequential(*full[rank * 2 * layers : (rank + 1) * 2 * layers])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
    out: Dict[str, Any] = {}
    for name, m in runs:
        for fw in ("fairscale_c", "torch"):
            acc: Dict[str, float] = collections.defaultdict(float)
            acts: List[tuple] = []
            if fw == "fairscale_c":
                stage = fpp.PipelineStage(mod, rank, world)
                stage.group = stage.grad_group = _GroupProxy(stage.group, acc, [])
                for attr in ("recv_activation_ops", "send_activation_ops", "recv_gradient_ops", "send_gradient_ops"):
                    setattr(stage, attr, _Timed(acc, "build messages", getattr(stage, attr)))
                stage.forward_one = _Logged(acts, "F", stage.forward_one)
                stage.backward_one = _Logged(acts, "B", stage.backward_one)
                cls = {"gpipe": fpp.ScheduleGPipe, "1f1b": fpp.Schedule1F1B}[name]
                sched = cls(stage, m, _Timed(acc, "loss", F.mse_loss))
            else:
                tstage = tpp.PipelineStage(
                    mod, rank, world, torch.device("cpu"), input_args=(torch.empty(batch // m, d),)
                )
                cls = {"gpipe": tpp.ScheduleGPipe, "1f1b": tpp.Schedule1F1B}[name]
                sched = cls(tstage, m, loss_fn=F.mse_loss)
            rows: List[Dict[str, float]] = []
            for it in range(steps + 3):
                acc.clear()
                acts.clear()
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                opt.zero_grad(set_to_none=True)
                if rank == 0:
                    sched.step(x)
                else:
                    sched.step(target=y)
                opt.step()
                row = {"step": time.perf_counter() - t0, "cpu": time.process_time() - c0}
                if fw == "fairscale_c":
                    row["forward"] = sum(a[2] for a in acts if a[0] == "F")
                    row["backward"] = sum(a[2] for a in acts if a[0] == "B")
                    row["first F"] = next(a[2] for a in acts if a[0] == "F")
                    row["last B"] = [a[2] for a in acts if a[0] == "B"][-1]
                    row.update(acc)
                    named = row["forward"] + row["backward"] + sum(acc.values())
                    row["rest"] = row["step"] - named
                if it >= 3:
                    rows.append(row)
            out[f"{fw} {name} m={m}"] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=["gpipe:4", "1f1b:4", "1f1b:8"], help="schedule:m pairs")
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=4, help="(Linear, ReLU) pairs per stage")
    p.add_argument("--batch", type=int, default=480)
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    args = p.parse_args()
    runs = [(r.split(":")[0], int(r.split(":")[1])) for r in args.runs]
    print(f"load before {os.getloadavg()}")
    res = run_ranks(_job, 2, runs, args.d, args.layers, args.batch, args.steps, timeout=900)
    print(f"load after {os.getloadavg()}")
    ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    cols = ["forward", "backward", "loss", "sync wait", "async issue", "build messages", "rest"]
    print("| run | rank | step ms | cpu ms | " + " | ".join(cols) + " | torch step ms |")
    print("|---|---|---|---|" + "---|" * len(cols) + "---|")
    for name, m in runs:
        key = f"{name} m={m}"
        for r in range(2):
            a, t = res[r][f"fairscale_c {key}"], res[r][f"torch {key}"]
            print(
                f"| {key} | {r} | {ms(a['step'])} | {ms(a['cpu'])} | "
                + " | ".join(ms(a.get(c, 0.0)) for c in cols)
                + f" | {ms(t['step'])} |"
            )
        last = res[1][f"fairscale_c {key}"]
        floor = res[0][f"fairscale_c {key}"]["first F"] + last["forward"] + last["backward"] + last.get("loss", 0.0)
        floor += res[0][f"fairscale_c {key}"]["last B"]
        ours = max(res[r][f"fairscale_c {key}"]["step"] for r in range(2))
        theirs = max(res[r][f"torch {key}"]["step"] for r in range(2))
        print(
            f"{key}: floor {ms(floor)} ms; fairscale_c {ms(ours)} ms ({ours / floor:.3f}x floor); "
            f"torch {ms(theirs)} ms ({theirs / floor:.3f}x floor); torch / fairscale_c {theirs / ours:.3f}, "
            f"torch / floor {theirs / floor:.3f}"
        )


if __name__ == "__main__":
    main()
