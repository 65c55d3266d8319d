"""Schedules for multi-process pipelines: the order in which a stage runs its micro-batches.

``ScheduleGPipe``: every micro-batch forward, then every one backward (fill, drain). A stage holds
the activations of all ``n_microbatches`` at once.

``Schedule1F1B``: stage ``s`` of ``p`` runs ``p - 1 - s`` forwards, then alternates one forward
and one backward, then drains the backwards left. A stage holds at most ``p - s`` micro-batches'
activations, with the same bubble as GPipe.

``ScheduleInterleaved1F1B``: ``v`` stages per rank (Megatron-LM's order); the bubble shrinks by
``v`` for ``v`` times the messages.

``ScheduleLoopedBFS``: ``v`` stages per rank, breadth first: every micro-batch through the rank's
first stage, then its second, ...; backwards in the reverse order. The activations of GPipe.

All are driven the same way (the shape of ``torch.distributed.pipelining``'s)::

    stage = PipelineStage(module, rank, world, group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=F.cross_entropy)
    out = schedule.step(x)                             # stage 0: the whole batch
    out = schedule.step(target=y, losses=losses)       # last stage: targets, per-micro-batch losses
    out = schedule.step()                              # the stages between
    optimizer.step()

Before each action, the messages the previous one produced (its outputs forward, its input
gradients backward) and the receives this one needs go out together as one point-to-point batch
of the pipeline group (no order of issue across stages can deadlock): synchronously when there is
something to receive (on the calling thread when nothing is queued before it), else
asynchronously, so the sends overlap the computation. Every wait is bounded by
FAIRSCALE_C_TIMEOUT: a stage that dies makes the others raise ``fairscale_c.DistributedError``
instead of hanging.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from ._chunks import TensorChunkSpec, _batch_key, _Chunking, _norm_dim
from ._edges import _edge_class, _edge_groups, _second_group
from .stage import PipelineStage, as_tuple, describe, metas_of, resolve_group
from ...internal.args import as_int


@dataclass(frozen=True)
class Action:
    """One unit of a rank's work: ``kind`` "F" (forward) or "B" (backward) of micro-batch ``mb``
    on the rank's ``stage``-th stage (always 0 but for the interleaved schedule)."""

    kind: str
    mb: int
    stage: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"@{self.stage}" if self.stage else "")


@dataclass(frozen=True)
class StepStats:
    """Timings of this rank's last step, in seconds of host time (on CUDA, compute is asynchronous
    and ``compute_s`` is the time spent launching it).

    ``step_s``: the whole step; ``compute_s``: inside forward, loss and backward; ``wait_s``:
    waiting for messages from the neighbouring stages; ``reduce_s``: the data-parallel gradient
    reduction. ``bubble`` is the share of the step spent outside compute."""

    step_s: float
    compute_s: float
    wait_s: float
    reduce_s: float
    n_microbatches: int

    @property
    def bubble(self) -> float:
        return 1.0 - self.compute_s / self.step_s if self.step_s > 0 else 0.0


class PipelineSchedule(_Chunking):
    """Base of the schedules; subclasses give :meth:`order`.

    Args:
        stage: this rank's :class:`PipelineStage` (ScheduleInterleaved1F1B, ScheduleLoopedBFS: a list
            of them).
        n_microbatches: micro-batches per step (>= 1); the batch is split along dimension 0 (or
            as ``args_chunk_spec`` says) ``torch.tensor_split``-style: when it does not divide
            evenly the first micro-batches are one sample larger.
        loss_fn: ``loss_fn(output, target)`` for one micro-batch, used on the last stage. Give it
            (or any callable) on every stage: without one a step is forward-only.
        args_chunk_spec: how to split stage 0's positional inputs: a tuple with one
            :class:`TensorChunkSpec` (split along its dim) or None (the whole tensor to every
            micro-batch) per input. Default: all along dim 0.
        kwargs_chunk_spec: the same for stage 0's keyword inputs, a dict with one entry per
            keyword. Default: tensors along dim 0, anything else to every micro-batch.
        output_merge_spec: how the last stage's outputs are merged into the step's result: a
            :class:`TensorChunkSpec` (one output) or a tuple of them (one per output); default:
            concatenated along dim 0.
        scale_grads: weight each micro-batch's loss by its share of the batch (its target's rows
            over the batch's; ``1 / n_microbatches`` for an even split) before its backward, so
            that a loss averaging over its micro-batch gives the gradients of the average over the
            whole batch (as in a single process).
        dp_group: optional data-parallel group (a torch ProcessGroup or a fairscale_c Group) of the
            ranks that run this same stage on other data: after the backward the stage's
            gradients are averaged over it (one flat all-reduce per dtype).
    """

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        dp_group: Any = None,
    ) -> None:
        name = type(self).__name__
        stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        if not stages or not all(isinstance(st, PipelineStage) for st in stages):
            what = ", ".join(type(st).__name__ for st in stages) or "an empty list"
            raise TypeError(f"{name}: stage must be a PipelineStage (interleaved: a list of them), got {what}")
        size = stages[0].group.size
        if not self._multi_stage and (len(stages) != 1 or stages[0].num_stages != size):
            raise ValueError(
                f"{name}: one stage per rank (num_stages == the pipeline group's size, {size}); for several "
                "stages per rank use ScheduleInterleaved1F1B or ScheduleLoopedBFS"
            )
        if any(st.group is not stages[0].group for st in stages):
            raise ValueError(f"{name}: the stages of one rank must share their pipeline group")
        if as_int(n_microbatches) is None:
            raise TypeError(f"{name}: n_microbatches must be an int, got {type(n_microbatches).__name__}")
        n_microbatches = as_int(n_microbatches)
        if n_microbatches < 1:
            raise ValueError(f"{name}: n_microbatches must be >= 1, got {n_microbatches}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{name}: loss_fn must be callable or None, got {type(loss_fn).__name__}")
        self._stages = sorted(stages, key=lambda st: st.stage_index)
        self._first = next((st for st in self._stages if st.is_first), None)
        self._last = next((st for st in self._stages if st.is_last), None)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._args_dims = self._check_args_spec(args_chunk_spec)
        self._kwargs_dims = self._check_kwargs_spec(kwargs_chunk_spec)
        self._merge_dims = self._check_merge_spec(output_merge_spec)
        self.scale_grads = bool(scale_grads)
        self.dp_group = resolve_group(dp_group, "default", f"{name}: dp_group") if dp_group is not None else None
        self.last_step: Optional[StepStats] = None
        self._checked: Any = None  # the last batch whose micro-batches matched stage 0's set-up

    _multi_stage = False  # takes a list of this rank's stages (_MultiStageSchedule)
    # CUDA multi-stage schedules: one engine group per (message kind, edge class)
    _edge_groups: Optional[Dict[Tuple[str, int], Any]] = None
    # an action's sends join the next action's synchronous receives (run on the calling thread when
    # nothing is queued); a schedule whose sends may run many messages ahead of the peer's receives
    # turns it off, since such a batch would wait for its own send
    _sends_with_receives = True

    def _check_outputs(self, table: List[Tuple[Any, ...]]) -> str:
        """The last stage's set-up check of ``output_merge_spec`` against its outputs."""
        dims, n = self._merge_dims, len(table[0])
        if dims is None:
            return ""
        if len(dims) != n:
            return (
                f"output_merge_spec has {len(dims)} entries but stage {self._stages[-1].stage_index}'s module "
                f"returns {n} tensors"
            )
        for k, (dim, meta) in enumerate(zip(dims, table[0])):
            if _norm_dim(dim, len(meta.shape)) is None:
                return f"output_merge_spec[{k}] merges along dim {dim} but output[{k}] is {meta}"
        return ""

    @property
    def stage(self) -> PipelineStage:
        """This rank's (first) stage."""
        return self._stages[0]

    @property
    def stages(self) -> List[PipelineStage]:
        return list(self._stages)

    @property
    def n_microbatches(self) -> int:
        return self._n_microbatches

    def order(self, has_backward: bool = True) -> List[Action]:
        """This rank's actions in the order it runs them."""
        raise NotImplementedError

    # ------------------------------------------------------------------ driving
    def step(
        self, *args: Any, target: Any = None, losses: Optional[list] = None, return_outputs: bool = True, **kwargs: Any
    ) -> Any:
        """One training step over the whole batch. Stage 0 is given the batch (positional Tensors
        split along dimension 0) and any keyword arguments of its module (Tensors with a batch
        dimension split the same way, anything else passed to every micro-batch as it is); other
        stages' arguments are ignored. The last stage
        is given ``target`` (split the same way) and, optionally, a list ``losses`` that receives
        each micro-batch's loss (before scaling). Returns the last stage's outputs concatenated
        over the micro-batches (detached), ``None`` on other stages. Gradients accumulate into
        the stage's parameters; call the optimizer afterwards."""
        if self._loss_fn is not None and not torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__}.step: gradients are disabled (torch.no_grad); use eval()")
        return self._step(args, target, losses, return_outputs, has_backward=self._loss_fn is not None, kwargs=kwargs)

    def eval(self, *args: Any, target: Any = None, losses: Optional[list] = None, **kwargs: Any) -> Any:
        """Forward only (no gradients kept, nothing sent backward); losses are computed when the
        last stage has a ``loss_fn`` and a ``target``."""
        with torch.no_grad():
            return self._step(args, target, losses, True, has_backward=False, kwargs=kwargs)

    def _step(
        self,
        args: tuple,
        target: Any,
        losses: Optional[list],
        return_outputs: bool,
        has_backward: bool,
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        name, first, last, m = type(self).__name__, self._first, self._last, self._n_microbatches
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"{name}.step: losses must be a list or None, got {type(losses).__name__}")
        if first is not None:
            wrong = [str(a.device) for a in args if isinstance(a, torch.Tensor) and a.device != first.device]
            if wrong:
                raise ValueError(
                    f"{name}.step: the batch is on {', '.join(sorted(set(wrong)))} but stage 0 computes on "
                    f"{first.device}; move it there first"
                )
        mbs = self._split(args, "the batch", self._args_dims) if first is not None else None
        mb_kwargs = self._split_kwargs(kwargs or {}, args) if first is not None else None
        targets, divisors = None, [float(m if self.scale_grads else 1)] * m
        if last is not None and self._loss_fn is not None:
            if target is None and has_backward:
                raise ValueError(f"{name}.step: the last stage needs target= (the loss function's target)")
            if target is not None:
                targets = self._split(as_tuple(target), "target")
                rows = [t[0].shape[0] for t in targets]
                if self.scale_grads and len(set(rows)) > 1:  # uneven: each by its share of the batch
                    divisors = [sum(rows) / r for r in rows]
        for stage in self._stages:
            if stage.ready and len(stage.input_metas or ()) != m:
                raise ValueError(
                    f"{name}: stage {stage.stage_index} was set up for {len(stage.input_metas or ())} micro-batches, "
                    f"this schedule has n_microbatches={m}; a stage serves schedules of one micro-batch count"
                )
        t0 = time.perf_counter()
        if any(not stage.ready for stage in self._stages):
            self._agree_settings(has_backward)
        for stage in self._stages:  # every rank in the same order: along the pipeline
            if not stage.ready:
                check = self._check_outputs if stage.is_last else None
                if stage.is_first:
                    stage.setup(mbs, mb_kwargs, m, check)
                else:
                    stage.setup(None, None, m, check)
        if first is not None and mbs is not None and self._checked != _batch_key(args, kwargs):
            got = [metas_of(mb, "step: the micro-batch") for mb in mbs]
            if got != first.input_metas:
                k = next((i for i, (a, b) in enumerate(zip(got, first.input_metas or ())) if a != b), 0)
                raise ValueError(
                    f"{name}.step: stage 0's micro-batch {k} is {describe(got[k])} but the pipeline was set up "
                    f"for {describe((first.input_metas or [()])[k])}; every step must have the same shapes"
                )
            self._checked = _batch_key(args, kwargs)  # the split of a batch like this one fits: skip next time
        for stage in self._stages:
            stage.clear()
        mb_losses: List[torch.Tensor] = []
        try:
            compute_s, wait_s = self._run(mbs, targets, mb_losses, has_backward, mb_kwargs, divisors)
            t1 = time.perf_counter()
            if self.dp_group is not None and has_backward:
                self._reduce_gradients()
        except BaseException:
            self._give_up()
            raise
        t2 = time.perf_counter()
        self.last_step = StepStats(t2 - t0, compute_s, wait_s, t2 - t1, m)
        if losses is not None and last is not None:
            losses.clear()
            losses.extend(mb_losses)
        if last is None or not return_outputs:
            if last is not None:
                last.output_chunks = []
            return None
        chunks, last.output_chunks = last.output_chunks, []
        dims = self._merge_dims or (0,) * len(chunks[0])
        merged = tuple(torch.cat([c[k] for c in chunks], dim=d) for k, d in enumerate(dims))
        return merged[0] if len(merged) == 1 else merged

    def _run(
        self,
        mbs: Optional[List[Tuple[torch.Tensor, ...]]],
        targets: Optional[List[Tuple[torch.Tensor, ...]]],
        mb_losses: List[torch.Tensor],
        has_backward: bool,
        mb_kwargs: Optional[List[Dict[str, Any]]],
        divisors: List[float],
    ) -> Tuple[float, float]:
        """Run this rank's actions; micro-batch i's loss is divided by ``divisors[i]`` before its
        backward."""
        inflight: Deque[Any] = deque()  # Works of sends not yet known to be finished, oldest first
        compute_s = wait_s = 0.0
        sends: list = []  # the previous action's messages, not yet issued
        sends_group: Any = None
        for action in self.order(has_backward):
            stage = self._stages[action.stage]
            group = self._group_of(stage, action.kind, sending=False)
            recvs = self._receives(action)
            if sends and (not recvs or sends_group is not group or not self._sends_with_receives):
                inflight.append(sends_group.batch(sends, async_op=True))  # overlaps the next computation
                sends = []
            if recvs:
                # needed now: one synchronous batch with the previous action's messages. When
                # nothing is queued before it, it runs on this thread: no hand-off to the group's
                # progress thread and back on the critical path between the stages
                t = time.perf_counter()
                group.batch(sends + recvs)
                wait_s += time.perf_counter() - t
            while inflight and inflight[0].is_completed():
                inflight.popleft().wait()  # releases its tensors; raises if it failed
            t = time.perf_counter()
            if action.kind == "F":
                args = mbs[action.mb] if stage.is_first and mbs is not None else None
                kw = mb_kwargs[action.mb] if stage.is_first and mb_kwargs is not None else None
                out = stage.forward_one(action.mb, args, has_backward, kw)
                if stage.is_last and targets is not None:
                    loss = self._loss_fn(out, *targets[action.mb])  # type: ignore[misc]
                    mb_losses.append(loss.detach())
                    if has_backward:
                        stage.set_loss(action.mb, loss)
            else:
                stage.backward_one(action.mb, divisors[action.mb])
            compute_s += time.perf_counter() - t
            sends = self._sends(action)
            sends_group = self._group_of(stage, action.kind, sending=True)
            if action.kind == "F" and not has_backward:
                stage.drop_forward_state(action.mb)
        t = time.perf_counter()
        if sends:
            sends_group.batch(sends)
        while inflight:
            inflight.popleft().wait()
        wait_s += time.perf_counter() - t
        return compute_s, wait_s

    def _agree_settings(self, has_backward: bool) -> None:
        """At set-up, the settings every rank's schedule must share, compared over the pipeline
        group (one all_gather): a mismatch is the same ValueError naming the argument on every
        rank, where it would be a send/recv mismatch at the first message (n_microbatches,
        num_stages) or stages waiting for each other until the timeout (a loss_fn missing on some
        ranks: they disagree on whether the step has a backward)."""
        name, group = type(self).__name__, self._stages[0].group
        mine = torch.tensor([self._n_microbatches, self._stages[0].num_stages, int(has_backward)], dtype=torch.int64)
        every = torch.empty(3 * group.size, dtype=torch.int64)
        group.all_gather(every, mine)
        rows = every.view(group.size, 3).tolist()
        for k, what in enumerate(("n_microbatches", "num_stages")):
            if len({r[k] for r in rows}) > 1:
                given = ", ".join(f"rank {i}: {r[k]}" for i, r in enumerate(rows))
                raise ValueError(
                    f"{name}: the pipeline's ranks disagree on {what} ({given}); every rank must give the same"
                )
        if len({r[2] for r in rows}) > 1:
            with_loss = [i for i, r in enumerate(rows) if r[2]]
            without = [i for i, r in enumerate(rows) if not r[2]]
            raise ValueError(
                f"{name}: loss_fn is given on rank(s) {with_loss} and not on {without}; give it on every stage "
                "(it decides whether a step has a backward)"
            )

    def _give_up(self) -> None:
        """After a step raised part way (a module, the loss, Ctrl-C, a peer's failure): the other
        stages wait for messages this rank will not send, and a next step of this rank's would be
        out of step with theirs. Give up on every group the schedule talks on, so that every stage
        raises DistributedError at once instead of at the timeout (Group.abort)."""
        groups = [g for st in self._stages for g in (st.group, st.grad_group)]
        groups += list((self._edge_groups or {}).values())
        groups.append(self.dp_group)
        for g in {id(g): g for g in groups if g is not None}.values():
            g.abort()

    def _group_of(self, stage: PipelineStage, kind: str, sending: bool) -> Any:
        """The engine group of the messages a ``kind`` ("F" or "B") action of ``stage`` sends (or
        receives): activations on the pipeline group, gradients on ``stage.grad_group``."""
        return stage.group if kind == "F" else stage.grad_group

    def _receives(self, action: Action) -> list:
        stage = self._stages[action.stage]
        if action.kind == "F" and not stage.is_first:
            return stage.recv_activation_ops(action.mb)
        if action.kind == "B" and not stage.is_last:
            return stage.recv_gradient_ops(action.mb)
        return []

    def _sends(self, action: Action) -> list:
        stage = self._stages[action.stage]
        if action.kind == "F" and not stage.is_last:
            return stage.send_activation_ops(action.mb)
        if action.kind == "B" and not stage.is_first:
            return stage.send_gradient_ops(action.mb)
        return []

    def _reduce_gradients(self) -> None:
        """Average this stage's gradients over the data-parallel group: one flat all-reduce per
        (dtype, device) of every parameter that requires grad, in the same order on every replica,
        whether or not this replica's step used it (zeros where it did not), followed by one flag
        per parameter: a parameter no replica used keeps no gradient; one that some used gets the
        average, as DDP gives it."""
        groups: Dict[Tuple[torch.dtype, torch.device], List[torch.nn.Parameter]] = {}
        seen: set = set()
        for p in (p for st in self._stages for p in st.module.parameters()):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                groups.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), params in groups.items():
            grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
            used = torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)
            flat = torch.cat(grads + [used])
            self.dp_group.all_reduce(flat, op="avg")
            parts = flat.split([p.numel() for p in params] + [len(params)])
            flags = parts[-1].tolist() if any(p.grad is None for p in params) else [1.0] * len(params)
            for p, part, flag in zip(params, parts, flags):
                if p.grad is not None:
                    p.grad.copy_(part.view_as(p))
                elif flag > 0:
                    p.grad = part.view_as(p).clone()


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards (micro-batches in order both times)."""

    def order(self, has_backward: bool = True) -> List[Action]:
        m = self._n_microbatches
        fwd = [Action("F", i) for i in range(m)]
        return fwd + [Action("B", i) for i in range(m)] if has_backward else fwd


class Schedule1F1B(PipelineSchedule):
    """1F1B: ``p - 1 - s`` warm-up forwards on stage ``s``, then one forward and one backward in
    turn, then the remaining backwards; at most ``p - s`` micro-batches in flight per stage."""

    def order(self, has_backward: bool = True) -> List[Action]:
        m, stage = self._n_microbatches, self._stages[0]
        if not has_backward:
            return [Action("F", i) for i in range(m)]
        warmup = min(stage.num_stages - 1 - stage.stage_index, m)
        out = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            out += [Action("F", warmup + i), Action("B", i)]
        out += [Action("B", i) for i in range(m - warmup, m)]
        return out


class _MultiStageSchedule(PipelineSchedule):
    """A schedule of ``v * p`` stages on ``p`` ranks, rank ``r`` running stages ``r, r + p, ...,
    r + (v - 1) p`` (passed as a list). Gradients travel on an engine group of their own (built
    here, a collective over the pipeline group): with two ranks, activations and gradients go
    between the same pair in the same direction, and messages are matched in order per channel; on
    separate groups each kind is in the same order on both sides by construction (every rank runs
    forwards in the same (stage, micro-batch) order as its neighbours, backwards likewise), whatever
    the interleaving of the two.

    On CUDA each kind goes further, onto one NCCL communicator per class of pipeline edge
    (:func:`_edge_class`), so that on every communicator a rank only sends or only receives. NCCL
    matches a pair's messages in the order each communicator issued them, and a large send does
    not finish before its receive has started: a rank's send queued behind its own receive, while
    the peer's matching receive is queued behind the peer's send, deadlocks. These schedules send
    micro-batches ahead (looped BFS all of a stage's forwards), and the CPU layout cannot finish
    under these rules (docs/pipe_stages.md). With one direction per communicator a send waits only
    for the receives queued before its own, which the receiver issues in the sender's order
    (tests/test_pipe_nccl_plan.py plays both layouts)."""

    _multi_stage = True
    _microbatch_multiple = False  # n_microbatches must be a multiple of the group's size

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        dp_group: Any = None,
    ) -> None:
        super().__init__(
            stages,  # type: ignore[arg-type]
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            dp_group=dp_group,
        )
        name, group = type(self).__name__, self._stages[0].group
        p, rank, n = group.size, group.rank, self._stages[0].num_stages
        want = list(range(rank, n, p))
        got = [st.stage_index for st in self._stages]
        if got != want or any(st.num_stages != n for st in self._stages):
            raise ValueError(
                f"{name}: rank {rank} of {p} must hold stages {want} of the {n}-stage pipeline, got stages {got} "
                f"(of {sorted({st.num_stages for st in self._stages})}-stage pipelines)"
            )
        if self._microbatch_multiple and n_microbatches % p:
            raise ValueError(
                f"{name}: n_microbatches={n_microbatches} must be a multiple of the pipeline group's size ({p})"
            )
        device = self._stages[0].device
        if p > 1 and device.type == "cuda":
            self._edge_groups = _edge_groups(group, device)
        elif p > 1:
            grad_group = _second_group(group)
            for st in self._stages:
                st.grad_group = grad_group

    def _group_of(self, stage: PipelineStage, kind: str, sending: bool) -> Any:
        if self._edge_groups is None:
            return super()._group_of(stage, kind, sending)
        rank = stage.group.rank
        src = rank if sending else (stage.prev if kind == "F" else stage.next)
        return self._edge_groups[(kind, _edge_class(kind, src, stage.group.size))]


class ScheduleInterleaved1F1B(_MultiStageSchedule):
    """Interleaved 1F1B (Megatron-LM's): a pipeline of ``v * p`` stages on ``p`` ranks, rank ``r``
    running stages ``r, r + p, ..., r + (v - 1) p`` (pass them as a list). Micro-batches go
    through in groups of ``p``: each rank runs a group on its first stage, then on its second, ...;
    after ``2 (p - 1 - r) + (v - 1) p`` warm-up forwards it alternates forward and backward. The
    ideal bubble shrinks by ``v`` to (p - 1) / (v m + p - 1), for about ``v`` times the messages.
    ``n_microbatches`` must be a multiple of ``p``.
    """

    _microbatch_multiple = True

    def order(self, has_backward: bool = True) -> List[Action]:
        group = self._stages[0].group
        p, v, m, rank = group.size, len(self._stages), self._n_microbatches, group.rank
        total = m * v

        def action(kind: str, k: int) -> Action:
            chunk = (k % (p * v)) // p
            return Action(kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

        if not has_backward:
            return [action("F", k) for k in range(total)]
        warmup = min(2 * (p - 1 - rank) + (v - 1) * p, total)
        out = [action("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            out += [action("F", warmup + k), action("B", k)]
        out += [action("B", k) for k in range(total - warmup, total)]
        return out


class ScheduleLoopedBFS(_MultiStageSchedule):
    """Looped breadth-first (torch.distributed.pipelining's ScheduleLoopedBFS): ``v * p`` stages
    on ``p`` ranks, rank ``r`` running stages ``r, r + p, ...`` (pass them as a list). Each rank
    runs the forwards of every micro-batch on its first stage, then on its second, ...; then the
    backwards stage by stage in the reverse order, the micro-batches of each in reverse. Like
    GPipe it keeps every micro-batch's activations of every one of its stages until the backward;
    any ``n_microbatches`` >= 1."""

    _sends_with_receives = False

    def order(self, has_backward: bool = True) -> List[Action]:
        v, m = len(self._stages), self._n_microbatches
        fwd = [Action("F", i, s) for s in range(v) for i in range(m)]
        if not has_backward:
            return fwd
        return fwd + [Action("B", i, s) for s in reversed(range(v)) for i in reversed(range(m))]


__all__ = [
    "Action",
    "PipelineSchedule",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "StepStats",
    "TensorChunkSpec",
]
