"""Where a CPU pipeline step spends the time between two computations: two stages (one per
process) of 4 x (Linear(512), ReLU), batch 480, timed on the actions' own timestamps.

    PYTHONPATH=. python tools/pipe_gaps.py [--schedule 1f1b|gpipe] [--microbatches 8] [--steps 20]

Stage methods and the groups' `batch` are wrapped to record when each forward/backward and each
batch starts and ends (time.perf_counter: CLOCK_MONOTONIC, one clock for both processes). For a
stage-1 forward and a stage-0 backward, whose input comes from the other stage, it prints:
- "on the critical path": the message's producer finished after this rank's previous action, so
  the gap from the end of the producer's computation to the start of this one is the hand-off;
- "already there": the producer finished earlier, so the gap from this rank's previous action is
  the cost of moving on (Python between actions, and the synchronous batch that sends the
  previous action's output and receives this one's input), split into before / in / after the
  batch.
"""

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dist_utils import run_ranks  # noqa: E402


def _job(rank, world, schedule, m, steps):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from fairscale_c.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    torch.manual_seed(0)
    d, per_stage, batch = 512, 4, 480
    layers = [mod for _ in range(per_stage * world) for mod in (nn.Linear(d, d), nn.ReLU())]
    module = nn.Sequential(*layers[2 * per_stage * rank : 2 * per_stage * (rank + 1)])
    stage = PipelineStage(module, rank, world)
    sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, n_microbatches=m, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    now, actions, batches = time.perf_counter, [], []

    def timed(kind, fn):
        def run(mb, *a, **k):
            t = now()
            out = fn(mb, *a, **k)
            actions.append((kind, mb, t, now()))
            return out

        return run

    stage.forward_one, stage.backward_one = timed("F", stage.forward_one), timed("B", stage.backward_one)
    for grp in {id(stage.group): stage.group, id(stage.grad_group): stage.grad_group}.values():

        def batch(ops, *a, _batch=grp.batch, **k):
            t = now()
            out = _batch(ops, *a, **k)
            batches.append((t, now(), len(ops), bool(k.get("async_op", False))))
            return out

        grp.batch = batch

    def step():
        opt.zero_grad()
        sched.step(x) if stage.is_first else sched.step(target=y, losses=[])
        opt.step()

    for _ in range(5):
        step()
    out = []
    for _ in range(steps):
        actions.clear(), batches.clear()
        stage.group.barrier()
        t0 = now()
        step()
        out.append((t0, now(), list(actions), list(batches)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    runs = run_ranks(_job, 2, args.schedule, args.microbatches, args.steps)
    critical, there, parts, kinds, step_s = collections.defaultdict(list), collections.defaultdict(list), [], [], []
    for s in range(args.steps):
        step_s.append(max(runs[0][s][1], runs[1][s][1]) - min(runs[0][s][0], runs[1][s][0]))
        ends = [{(k, mb): b for k, mb, _, b in runs[r][s][2]} for r in (0, 1)]
        for r in (0, 1):
            acts = runs[r][s][2]
            for j, (kind, mb, start, _) in enumerate(acts):
                if kind == "F" and r == 1:
                    dep, what = ends[0][("F", mb)], "activation"
                elif kind == "B" and r == 0:
                    dep, what = ends[1][("B", mb)], "gradient"
                else:
                    continue
                prev = acts[j - 1][3] if j else runs[r][s][0]
                if dep > prev:
                    critical[what].append(start - dep)
                    continue
                there[what].append(start - prev)
                bs = [b for b in runs[r][s][3] if prev <= b[0] and b[1] <= start]
                if bs:
                    parts.append((bs[0][0] - prev, sum(b[1] - b[0] for b in bs), start - bs[-1][1]))
                    kinds.append(tuple((n, asy) for _, _, n, asy in bs))

    def us(v):
        if not v:
            return "none"
        v = sorted(x * 1e6 for x in v)
        return f"median {v[len(v) // 2]:.0f}, p10 {v[len(v) // 10]:.0f}, p90 {v[9 * len(v) // 10]:.0f} us (n={len(v)})"

    print(f"{args.schedule}, m={args.microbatches}: step median {statistics.median(step_s) * 1e3:.1f} ms")
    for what in ("activation", "gradient"):
        print(f"{what} on the critical path (producer's end -> consumer's start): {us(critical[what])}")
        print(f"{what} already there (previous action's end -> start): {us(there[what])}")
    if parts:
        for i, name in enumerate(("before the batch", "in the batch(es)", "after the batch")):
            print(f"  already there, {name}: {us([p[i] for p in parts])}")
        print("  batches in those gaps (ops, async):", collections.Counter(kinds).most_common(3))
    for r in (0, 1):
        for kind in "FB":
            v = [b - a for s in range(args.steps) for k, _, a, b in runs[r][s][2] if k == kind]
            print(f"stage {r} {kind}: median {statistics.median(v) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
