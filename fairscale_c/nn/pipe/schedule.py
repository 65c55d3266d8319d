"""Schedules for multi-process pipelines: the order in which a stage runs its micro-batches.

``ScheduleGPipe``: every micro-batch forward, then every one backward (fill, drain). A stage holds
the activations of all ``n_microbatches`` at once.

``Schedule1F1B``: stage ``s`` of ``p`` runs ``p - 1 - s`` forwards, then alternates one forward
and one backward, then drains the backwards left. A stage holds at most ``p - s`` micro-batches'
activations, with the same bubble as GPipe.

Both are driven the same way (the shape of ``torch.distributed.pipelining``'s)::

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
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from .stage import PipelineStage, as_tuple, describe, metas_of, resolve_group


@dataclass(frozen=True)
class Action:
    """One unit of a stage's work: ``kind`` "F" (forward) or "B" (backward) of micro-batch ``mb``."""

    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


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


class PipelineSchedule:
    """Base of the single-stage-per-rank schedules; subclasses give :meth:`order`.

    Args:
        stage: this rank's :class:`PipelineStage`.
        n_microbatches: micro-batches per step (>= 1); the batch is split along dimension 0 and
            its size must be divisible by it.
        loss_fn: ``loss_fn(output, target)`` for one micro-batch, used on the last stage. Give it
            (or any callable) on every stage: without one a step is forward-only.
        scale_grads: divide each micro-batch's loss by ``n_microbatches`` before its backward, so
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
        *,
        scale_grads: bool = True,
        dp_group: Any = None,
    ) -> None:
        name = type(self).__name__
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{name}: stage must be a PipelineStage, got {type(stage).__name__}")
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool):
            raise TypeError(f"{name}: n_microbatches must be an int, got {type(n_microbatches).__name__}")
        if n_microbatches < 1:
            raise ValueError(f"{name}: n_microbatches must be >= 1, got {n_microbatches}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{name}: loss_fn must be callable or None, got {type(loss_fn).__name__}")
        self._stage = stage
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = bool(scale_grads)
        self.dp_group = resolve_group(dp_group, "default", f"{name}: dp_group") if dp_group is not None else None
        self.last_step: Optional[StepStats] = None

    @property
    def stage(self) -> PipelineStage:
        return self._stage

    @property
    def n_microbatches(self) -> int:
        return self._n_microbatches

    def order(self, has_backward: bool = True) -> List[Action]:
        """This stage's actions in the order it runs them."""
        raise NotImplementedError

    # ------------------------------------------------------------------ driving
    def step(self, *args: Any, target: Any = None, losses: Optional[list] = None, return_outputs: bool = True) -> Any:
        """One training step over the whole batch. Stage 0 is given the batch (positional Tensors
        split along dimension 0); other stages' positional arguments are ignored. The last stage
        is given ``target`` (split the same way) and, optionally, a list ``losses`` that receives
        each micro-batch's loss (before scaling). Returns the last stage's outputs concatenated
        over the micro-batches (detached), ``None`` on other stages. Gradients accumulate into
        the stage's parameters; call the optimizer afterwards."""
        if self._loss_fn is not None and not torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__}.step: gradients are disabled (torch.no_grad); use eval()")
        return self._step(args, target, losses, return_outputs, has_backward=self._loss_fn is not None)

    def eval(self, *args: Any, target: Any = None, losses: Optional[list] = None) -> Any:
        """Forward only (no gradients kept, nothing sent backward); losses are computed when the
        last stage has a ``loss_fn`` and a ``target``."""
        with torch.no_grad():
            return self._step(args, target, losses, True, has_backward=False)

    def _step(self, args: tuple, target: Any, losses: Optional[list], return_outputs: bool, has_backward: bool) -> Any:
        name, stage, m = type(self).__name__, self._stage, self._n_microbatches
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"{name}.step: losses must be a list or None, got {type(losses).__name__}")
        mbs = self._split(args, "the batch") if stage.is_first else None
        targets = None
        if stage.is_last and self._loss_fn is not None:
            if target is None and has_backward:
                raise ValueError(f"{name}.step: the last stage needs target= (the loss function's target)")
            if target is not None:
                targets = self._split(as_tuple(target), "target")
        t0 = time.perf_counter()
        if not stage.ready:
            stage.setup(mbs[0] if mbs is not None else None)
        if mbs is not None:
            got = metas_of(mbs[0], "step: the micro-batch")
            if got != stage.input_meta:
                raise ValueError(
                    f"{name}.step: stage 0's micro-batch is {describe(got)} but the pipeline was set up for "
                    f"{describe(stage.input_meta or ())}; every step must have the same shapes"
                )
        stage.clear()
        mb_losses: List[torch.Tensor] = []
        compute_s, wait_s = self._run(mbs, targets, mb_losses, has_backward)
        t1 = time.perf_counter()
        if self.dp_group is not None and has_backward:
            self._reduce_gradients()
        t2 = time.perf_counter()
        self.last_step = StepStats(t2 - t0, compute_s, wait_s, t2 - t1, m)
        if losses is not None and stage.is_last:
            losses.clear()
            losses.extend(mb_losses)
        if not (stage.is_last and return_outputs):
            stage.output_chunks = []
            return None
        chunks, stage.output_chunks = stage.output_chunks, []
        merged = tuple(torch.cat([c[k] for c in chunks]) for k in range(len(chunks[0])))
        return merged[0] if len(merged) == 1 else merged

    def _split(self, args: tuple, what: str) -> List[Tuple[torch.Tensor, ...]]:
        name, m = type(self).__name__, self._n_microbatches
        if not args:
            raise ValueError(f"{name}.step: stage 0 needs the batch as positional Tensors, got none")
        sizes = set()
        for k, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{name}.step: {what}[{k}] must be a Tensor, got {type(a).__name__}")
            if a.dim() == 0:
                raise ValueError(f"{name}.step: {what}[{k}] is a scalar; expected a batch dimension (dim 0)")
            sizes.add(a.shape[0])
        if len(sizes) != 1:
            raise ValueError(f"{name}.step: {what} tensors have different batch sizes {sorted(sizes)} (dim 0)")
        size = sizes.pop()
        if size % m:
            raise ValueError(
                f"{name}.step: {what} has {size} samples (dim 0), not divisible by n_microbatches={m}; "
                "micro-batches must be equal so that averaging their losses gives the batch's average"
            )
        parts = [torch.tensor_split(a.contiguous(), m, dim=0) for a in args]
        return [tuple(p[i] for p in parts) for i in range(m)]

    def _run(
        self,
        mbs: Optional[List[Tuple[torch.Tensor, ...]]],
        targets: Optional[List[Tuple[torch.Tensor, ...]]],
        mb_losses: List[torch.Tensor],
        has_backward: bool,
    ) -> Tuple[float, float]:
        stage, group = self._stage, self._stage.group
        divisor = self._n_microbatches if self.scale_grads else 1
        inflight: Deque[Any] = deque()  # Works of sends not yet known to be finished, oldest first
        compute_s = wait_s = 0.0
        sends: list = []  # the previous action's messages, not yet issued
        for action in self.order(has_backward):
            recvs = self._receives(action)
            if recvs:
                # needed now: one synchronous batch with the previous action's messages. When
                # nothing is queued before it, it runs on this thread: no hand-off to the group's
                # progress thread and back on the critical path between the stages
                t = time.perf_counter()
                group.batch(sends + recvs)
                wait_s += time.perf_counter() - t
            elif sends:
                inflight.append(group.batch(sends, async_op=True))  # overlaps the next computation
            while inflight and inflight[0].is_completed():
                inflight.popleft().wait()  # releases its tensors; raises if it failed
            t = time.perf_counter()
            if action.kind == "F":
                out = stage.forward_one(action.mb, mbs[action.mb] if mbs is not None else None, has_backward)
                if stage.is_last and targets is not None:
                    loss = self._loss_fn(out, *targets[action.mb])  # type: ignore[misc]
                    mb_losses.append(loss.detach())
                    if has_backward:
                        stage.set_loss(action.mb, loss)
            else:
                stage.backward_one(action.mb, divisor)
            compute_s += time.perf_counter() - t
            sends = self._sends(action)
            if action.kind == "F" and not has_backward:
                stage.drop_forward_state(action.mb)
        t = time.perf_counter()
        if sends:
            group.batch(sends)
        while inflight:
            inflight.popleft().wait()
        wait_s += time.perf_counter() - t
        return compute_s, wait_s

    def _receives(self, action: Action) -> list:
        stage = self._stage
        if action.kind == "F" and not stage.is_first:
            return stage.recv_activation_ops(action.mb)
        if action.kind == "B" and not stage.is_last:
            return stage.recv_gradient_ops(action.mb)
        return []

    def _sends(self, action: Action) -> list:
        stage = self._stage
        if action.kind == "F" and not stage.is_last:
            return stage.send_activation_ops(action.mb)
        if action.kind == "B" and not stage.is_first:
            return stage.send_gradient_ops(action.mb)
        return []

    def _reduce_gradients(self) -> None:
        """Average this stage's gradients over the data-parallel group: one flat all-reduce per
        (dtype, device)."""
        groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
        for p in self._stage.module.parameters():
            if p.grad is not None:
                groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in groups.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.dp_group.all_reduce(flat, op="avg")
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))


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
        m, stage = self._n_microbatches, self._stage
        if not has_backward:
            return [Action("F", i) for i in range(m)]
        warmup = min(stage.num_stages - 1 - stage.stage_index, m)
        out = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            out += [Action("F", warmup + i), Action("B", i)]
        out += [Action("B", i) for i in range(m - warmup, m)]
        return out


__all__ = ["Action", "PipelineSchedule", "Schedule1F1B", "ScheduleGPipe", "StepStats"]
