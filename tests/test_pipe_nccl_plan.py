"""The multi-process schedules' messages under NCCL's rules, without a GPU.

The real schedule loop (``PipelineSchedule._run``, its ``order()`` and its choice of groups) runs
on stand-in stages and groups that record, per rank, every batch it issues (group, sends and
receives, synchronous or not) between its computations. A small model then plays the records:

- each group is one NCCL communicator whose operations run one after another per rank, in the
  order issued (one side stream per group, and NCCL's own order);
- a batch may start once the rank has computed what it was issued after;
- a computation may start once every synchronous batch issued before it has finished;
- a pair's messages on a communicator match in issue order (NCCL has no tags);
- ``rendezvous``: a send finishes only once the batch holding its receive has started (large
  messages; NCCL buffers small ones). ``buffered``: a send finishes by itself, as on the
  shared-memory engine.

The plan must finish under both. With the gradients on one group of their own (the CPU layout),
interleaved 1F1B and looped BFS deadlock under ``rendezvous``; one communicator per kind and edge
class does not.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fairscale_c.nn.pipe import _edges as E
from fairscale_c.nn.pipe import schedule as S


class _Group:
    def __init__(self, name, size, rank, log):
        self.name, self.size, self.rank, self.log = name, size, rank, log
        self.connected = None

    def batch(self, ops, async_op=False):
        self.log.append(("nccl", self.name, list(ops), not async_op))
        return SimpleNamespace(is_completed=lambda: False, wait=lambda: None)

    def init_nccl(self, device=None):
        pass

    def connect(self, peers, device=None):
        self.connected = list(peers)


class _Stage:
    def __init__(self, s, n, group, log):
        p = group.size
        self.stage_index, self.num_stages, self.group, self.grad_group = s, n, group, group
        self.is_first, self.is_last = s == 0, s == n - 1
        self.prev, self.next = (s - 1) % p, (s + 1) % p
        self.device = torch.device("cuda")
        self.log = log

    def forward_one(self, mb, args, has_backward, kw=None):
        self.log.append(("compute",))
        return None

    def backward_one(self, mb, divisor):
        self.log.append(("compute",))

    def set_loss(self, mb, loss):
        pass

    def recv_activation_ops(self, mb):
        return [("recv", self.prev, ("act", self.stage_index - 1, mb))]

    def send_activation_ops(self, mb):
        return [("send", self.next, ("act", self.stage_index, mb))]

    def recv_gradient_ops(self, mb):
        return [("recv", self.next, ("grad", self.stage_index + 1, mb))]

    def send_gradient_ops(self, mb):
        return [("send", self.prev, ("grad", self.stage_index, mb))]


def _record(cls, p, v, m, layout, monkeypatch):
    """Every rank's log of one training step: ("compute",) and ("nccl", group, ops, sync)."""
    logs, groups = [], []
    for rank in range(p):
        log: list = []
        made = {}

        def second_group(group, role="pipeline_grad", log=log, made=made, rank=rank):
            made[role] = _Group(role, p, rank, log)
            return made[role]

        monkeypatch.setattr(E, "_second_group", second_group)
        pipe = _Group("pipeline", p, rank, log)
        stages = [_Stage(rank + j * p, p * v, pipe, log) for j in range(v)]
        sched = object.__new__(cls)
        sched._stages, sched._n_microbatches = stages, m
        sched._loss_fn = lambda out, *target: torch.zeros(())
        if layout == "edges":
            sched._edge_groups = E._edge_groups(pipe, torch.device("cuda"))
        elif layout == "cpu":  # gradients on one group of their own
            sched._edge_groups = None
            grad = second_group(pipe)
            for st in stages:
                st.grad_group = grad
        # "single" (one stage per rank): everything on the pipeline group, on both devices
        sched._run(None, [()] * m, [], True, None, [1.0] * m)
        logs.append(log)
        groups.append(made)
    return logs, groups


def _play(logs, rendezvous):
    """'ok', or a description of where the plan stops."""
    ops = []  # (rank, group, parts, sync, computes issued before)
    for rank, log in enumerate(logs):
        done = 0
        for entry in log:
            if entry[0] == "compute":
                done += 1
            else:
                ops.append((rank, entry[1], entry[2], entry[3], done))
    queues: dict = {}
    for k, (rank, group, parts, _, _) in enumerate(ops):
        for j, (kind, peer, key) in enumerate(parts):
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            queues.setdefault((group, src, dst, kind), []).append((k, j, key))
    match = {}
    for (group, src, dst, kind), sends in queues.items():
        if kind != "send":
            continue
        recvs = queues.get((group, src, dst, "recv"), [])
        if [key for _, _, key in sends] != [key for _, _, key in recvs]:
            return f"messages {src}->{dst} on {group} are received in another order than sent"
        for (ks, js, _), (kr, jr, _) in zip(sends, recvs):
            match[(ks, js)], match[(kr, jr)] = kr, ks
    started, finished = set(), set()
    computed = [0] * len(logs)
    computes = [sum(e[0] == "compute" for e in log) for log in logs]
    progress = True
    while progress:
        progress = False
        last: dict = {}
        for k, (rank, group, _, _, after) in enumerate(ops):
            prev, last[(rank, group)] = last.get((rank, group)), k
            if k not in started and (prev is None or prev in finished) and computed[rank] >= after:
                started.add(k)
                progress = True
        for k, (_, _, parts, _, _) in enumerate(ops):
            if k in started and k not in finished:
                waits = [match[(k, j)] for j, (kind, _, _) in enumerate(parts) if rendezvous or kind == "recv"]
                if all(w in started for w in waits):
                    finished.add(k)
                    progress = True
        for rank in range(len(logs)):
            while computed[rank] < computes[rank]:
                blocking = [k for k, o in enumerate(ops) if o[0] == rank and o[3] and o[4] <= computed[rank]]
                if not all(k in finished for k in blocking):
                    break
                computed[rank] += 1
                progress = True
    if len(finished) == len(ops) and computed == computes:
        return "ok"
    k = min(set(range(len(ops))) - finished)
    return f"stops at rank {ops[k][0]}'s batch on {ops[k][1]}: {[key for _, _, key in ops[k][2]]}"


MULTI = [S.ScheduleInterleaved1F1B, S.ScheduleLoopedBFS]
SHAPES = [(2, 2, 4), (2, 2, 8), (2, 3, 6), (3, 2, 6), (4, 2, 8), (4, 3, 12)]


@pytest.mark.parametrize("p,v,m", SHAPES)
@pytest.mark.parametrize("cls", MULTI, ids=lambda c: c.__name__)
def test_cuda_plan_of_multi_stage_schedules_finishes_under_nccl_rules(cls, p, v, m, monkeypatch):
    logs, groups = _record(cls, p, v, m, "edges", monkeypatch)
    assert _play(logs, rendezvous=True) == "ok"
    assert _play(logs, rendezvous=False) == "ok"
    for rank, made in enumerate(groups):
        # on every communicator a rank only sends or only receives
        for role in made:
            kinds = {kind for e in logs[rank] if e[0] == "nccl" and e[1] == role for kind, _, _ in e[2]}
            assert len(kinds) <= 1, (rank, role, kinds)
        # every pair is connected from both ends on the communicator it uses
        for role, g in made.items():
            for peer in g.connected:
                assert rank in groups[peer][role].connected, (rank, peer, role)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 7), (4, 8)])
@pytest.mark.parametrize("cls", [S.ScheduleGPipe, S.Schedule1F1B], ids=lambda c: c.__name__)
def test_plan_of_one_stage_per_rank_finishes_under_nccl_rules(cls, p, m, monkeypatch):
    """GPipe and 1F1B keep both directions on the pipeline group (on CUDA too); their plans finish
    under the same rules, so they need no other layout."""
    logs, _ = _record(cls, p, 1, m, "single", monkeypatch)
    assert _play(logs, rendezvous=True) == "ok"
    assert _play(logs, rendezvous=False) == "ok"


@pytest.mark.parametrize("cls", MULTI, ids=lambda c: c.__name__)
def test_the_cpu_layout_would_deadlock_on_nccl(cls, monkeypatch):
    """Why CUDA takes the edge layout: the CPU one finishes only where sends are buffered."""
    logs, _ = _record(cls, 2, 2, 8, "cpu", monkeypatch)
    assert _play(logs, rendezvous=False) == "ok"
    assert _play(logs, rendezvous=True).startswith("stops at")


@pytest.mark.parametrize("p,kind", [(2, "F"), (2, "B"), (3, "F"), (3, "B"), (4, "F"), (5, "B")])
def test_edge_classes_keep_each_rank_one_sided(p, kind):
    step = 1 if kind == "F" else -1
    for cls in range(3):
        edges = [(r, (r + step) % p) for r in range(p) if E._edge_class(kind, r, p) == cls]
        senders, receivers = {s for s, _ in edges}, {d for _, d in edges}
        assert not senders & receivers, (p, kind, cls, edges)
