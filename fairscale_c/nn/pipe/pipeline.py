"""The GPipe fill-drain schedule: every partition works on its own thread, on micro-batches in
order, as soon as its input has arrived (no barrier between clock cycles).

Each task (micro-batch i, partition j) keeps its own autograd graph, cut at the partition's
inputs: what arrives from partition j-1 (and skip tensors from earlier partitions) becomes a
leaf of task (i, j). The caller's graph sees the whole pipeline as one node (PipeFunction);
its backward hands each micro-batch's output gradient to the last partition, and each
partition, again on its own thread, runs backward through its task's graph (recomputing it
first when checkpointed, before the gradient arrives) and hands its input leaves' gradients to
the partition before it. Parameter gradients accumulate into ``.grad`` as usual.

Tasks hand values over through the run's Board (worker.py); partitions on CUDA devices compute
on the caller's current stream of their device and copy through copy streams (copy.py). CPU
partitions that have work at the same time share the caller's intra-op threads (threads.py).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Generator, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..checkpoint.checkpoint_activations import enable_checkpointing, enable_recomputing
from ...utils.replay import AutocastState
from ...utils.replay import autocast as _autocast
from ...utils.replay import autocast_state as _autocast_state
from . import microbatch, rng
from .copy import Hold, Streams, move
from .microbatch import Tensors
from .skip.layout import Key, SkipLayout
from .skip.tracker import SkipTracker, use_skip_tracker
from .threads import ThreadShare
from .worker import Board, Workers


@dataclass
class Task:
    """What task (micro-batch i, partition j) keeps between forward and backward."""

    leaves: Tensors  # the partition's inputs, cut from the previous partition's graph
    atomic: bool  # whether the partition received a Tensor (not a tuple)
    checkpointed: bool
    rng_state: Optional[rng.RNGState] = None
    outputs: Tensors = ()  # with the task's graph (after recomputation when checkpointed)
    stashed: Dict[Key, Optional[Tensor]] = field(default_factory=dict)  # skips leaving the partition
    popped: Dict[Key, Optional[Tensor]] = field(default_factory=dict)  # leaves of skips arriving


@dataclass
class Run:
    """One forward of the pipeline and, with autograd, its backward."""

    board: Board
    m: int
    grad: bool
    checkpoint_stop: int
    turns: Dict[Tuple[int, int], int]  # position of each task that takes turns (see rng.py)
    probing: bool
    signature: Tuple[bool, ...]
    autocast: AutocastState
    share: ThreadShare  # of the pass in progress
    tasks: Dict[Tuple[int, int], Task] = field(default_factory=dict)
    holds: List[Hold] = field(default_factory=list)
    turn: int = 0
    drew: List[bool] = field(default_factory=list)
    outputs: List[Tensors] = field(default_factory=list)
    output_atomic: bool = True

    def release(self) -> None:
        for hold in self.holds:
            hold.release()
        self.holds = []


class _PipeSkipTracker(SkipTracker):
    """Skip tensors of one task: those whose stash and pop are in the same partition stay in
    this tracker; those that cross partitions go through the run's board as leaves."""

    def __init__(self, pipeline: "Pipeline", run: Run, i: int, j: int, task: Task, recomputing: bool) -> None:
        super().__init__()
        self.pipeline, self.run, self.i, self.j, self.task = pipeline, run, i, j, task
        self.recomputing = recomputing

    @property
    def index(self) -> int:
        return self.i

    def save(self, ns: Any, name: str, tensor: Optional[Tensor]) -> None:
        if not self.pipeline.skip_layout.crosses(ns, name):
            return super().save(ns, name, tensor)
        self.task.stashed[(ns, name)] = tensor
        if self.recomputing:
            return
        flag = tensor is not None and _needs_grad(tensor, self.run.grad, self.task.checkpointed)
        self.run.board.put(("skip", self.i, (ns, name)), (None if tensor is None else tensor.detach(), flag))

    def load(self, ns: Any, name: str) -> Optional[Tensor]:
        if not self.pipeline.skip_layout.crosses(ns, name):
            return super().load(ns, name)
        key = (ns, name)
        if self.recomputing:
            value = self.task.popped[key]
            return None if value is None else _inputs_of((value,), copy=True)[0]
        # The stashing task ran before this one (it precedes it on the activations' path).
        value, flag = self.run.board.take(("skip", self.i, key))
        if value is not None:
            (value,) = move((value,), self.pipeline.devices[self.j], self.pipeline.streams, self.run.holds)
            value = value.detach().requires_grad_(flag)
        self.task.popped[key] = value
        return None if value is None else _inputs_of((value,), copy=self.task.checkpointed)[0]


def _needs_grad(t: Tensor, grad: bool, checkpointed: bool) -> bool:
    if not grad or not (t.is_floating_point() or t.is_complex()):
        return False
    # A checkpointed first pass runs without autograd; its floating outputs may need gradients.
    return t.requires_grad or checkpointed


class _Identity(torch.autograd.Function):
    """Gives a partition non-leaf inputs, so that in-place operations on them are allowed."""

    @staticmethod
    def forward(ctx: Any, *xs: Tensor) -> Tensors:
        return tuple(x.detach() for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Tensors:
        return grads


def _inputs_of(leaves: Tensors, copy: bool = False) -> Tensors:
    """What a partition is given of its input leaves. ``copy``: copies, for a checkpointed task,
    whose first pass and recomputation must both find the stored leaves unchanged whatever the
    partition does to its inputs in place (and whose recomputation must not change tensors a later
    partition saved for its backward)."""
    if copy:
        leaves = tuple(x.clone() for x in leaves)
    if torch.is_grad_enabled() and any(x.requires_grad and x.is_leaf for x in leaves):
        return _Identity.apply(*leaves)
    return leaves


class Pipeline:
    """Runs partitions on their devices; one Pipe owns one Pipeline."""

    def __init__(
        self, partitions: Sequence[nn.Sequential], devices: Sequence[torch.device], skip_layout: SkipLayout, mode: str
    ) -> None:
        self.partitions = list(partitions)
        self.devices = list(devices)
        self.skip_layout = skip_layout
        self.mode = mode
        self.workers = Workers(len(self.partitions))
        self.streams = Streams()
        self.share_threads = True  # False: every CPU partition uses the caller's count (threads.py)
        self.drawing: Dict[Tuple[bool, ...], List[bool]] = {}  # learned per training-flag setting

    # ----------------------------------------------------------------- forward

    def forward(self, batches: List[Tensors], atomic: bool, chunks: int) -> Run:
        """Run every micro-batch through every partition; the outputs are in ``run.outputs``."""
        n, m = len(self.partitions), len(batches)
        grad = torch.is_grad_enabled()
        stop = self._checkpoint_stop(chunks)
        signature = tuple(mod.training for p in self.partitions for mod in p.modules())
        learned = self.drawing.get(signature)
        ordered = [True] * n if learned is None else list(learned)
        run = Run(
            board=Board(),
            m=m,
            grad=grad,
            checkpoint_stop=stop,
            turns=rng.turn_order(m, n, ordered),
            probing=learned is None,
            signature=signature,
            autocast=_autocast_state(),
            share=self._share(),
            drew=[False] * n,
        )
        if any(d.type == "cuda" for d in self.devices):
            self.streams.capture(self.devices)
        for i, values in enumerate(batches):
            flags = tuple(_needs_grad(x, grad, False) for x in values)
            run.board.put(("act", i, 0), (values, flags, atomic))
            run.share.arrived(0)
        # The calling thread only waits. With one micro-batch nothing can overlap and partition
        # 0's worker runs every partition in turn (one hand-over). Not running the forward on the
        # caller's thread keeps the activations saved for backward out of its malloc arena, where
        # the backward's gradients and the caller's optimizer allocate, so glibc does not trim and
        # re-grow that heap every step (docs/pipe.md, "Memory and page faults").
        if m == 1:
            self.workers.submit(0, run.board.job(lambda: self._forward_partitions(run, range(n))))
        else:
            for j in range(n):
                self.workers.submit(j, run.board.job(lambda j=j: self._forward_partitions(run, [j])))
        try:
            run.board.join()
        except BaseException:
            run.release()
            raise
        if run.probing:
            self.drawing[signature] = run.drew
        outputs = []
        for i in range(m):
            values, _, out_atomic = run.board.slots.pop(("act", i, n))
            outputs.append(values)
        run.outputs, run.output_atomic = outputs, out_atomic
        if not grad:
            run.release()
        return run

    def _checkpoint_stop(self, chunks: int) -> int:
        """Micro-batches below this index are checkpointed (FairScale's rule)."""
        if not self.partitions[0].training:
            return 0
        return {"always": chunks, "except_last": chunks - 1, "never": 0}[self.mode]

    def can_run_whole(self, m: int, chunks: int) -> bool:
        """Whether `forward_whole` can take a run of `m` micro-batches: one, on CPU partitions
        only, and not checkpointed."""
        if m != 1 or any(d.type != "cpu" for d in self.devices):
            return False
        return not torch.is_grad_enabled() or self._checkpoint_stop(chunks) == 0

    def forward_whole(self, values: Tensors, atomic: bool) -> Tuple[Tensors, bool]:
        """One micro-batch through every partition in turn, on partition 0's worker, building
        one autograd graph in the caller's: its backward is a plain one, with nothing to hand
        over. Returns the outputs and whether the last partition returned a Tensor."""
        board, share, result = Board(), self._share(), []
        grad, autocast = torch.is_grad_enabled(), _autocast_state()

        def body() -> None:
            with torch.set_grad_enabled(grad), _autocast(autocast), use_skip_tracker(SkipTracker()):
                xs, single = _inputs_of(values), atomic
                with share.computing(0):  # alone: all of the caller's threads
                    for j, partition in enumerate(self.partitions):
                        out = partition(xs[0] if single else xs)
                        microbatch.check(out, f"the output of partition {j}")
                        xs, single = microbatch.as_tuple(out), isinstance(out, Tensor)
                result.append((xs, single))

        self.workers.submit(0, board.job(body))
        board.join()
        return result[0]

    def _forward_partitions(self, run: Run, parts: Iterable[int]) -> None:
        # The caller's grad mode is thread-local: the worker takes it from the run.
        with torch.set_grad_enabled(run.grad):
            for j in parts:
                self._forward_partition(run, j)

    def _forward_partition(self, run: Run, j: int) -> None:
        device = self.devices[j]
        with self._on_device(device), _autocast(run.autocast):
            for i in range(run.m):
                values, flags, atomic = run.board.take(("act", i, j))
                values = move(values, device, self.streams, run.holds)
                checkpointed = run.grad and i < run.checkpoint_stop
                if run.grad and j == 0 and run.m > 1:
                    # Micro-batches of one batch share its version counter: an in-place operation
                    # on one would invalidate what another saved for backward. Copies do not.
                    leaves = tuple(x.detach().clone().requires_grad_(f) for x, f in zip(values, flags))
                elif run.grad:
                    leaves = tuple(x.detach().requires_grad_(f) for x, f in zip(values, flags))
                else:
                    leaves = values
                task = Task(leaves=leaves, atomic=atomic, checkpointed=checkpointed)
                out = self._run_task(run, i, j, task)
                microbatch.check(out, f"the output of partition {j}")
                outs = microbatch.as_tuple(out)
                if run.grad:
                    if not checkpointed:
                        task.outputs = outs
                    run.tasks[(i, j)] = task
                out_flags = tuple(_needs_grad(y, run.grad, checkpointed) for y in outs)
                run.board.put(("act", i, j + 1), (tuple(y.detach() for y in outs), out_flags, isinstance(out, Tensor)))
                if j + 1 < len(self.partitions):
                    run.share.arrived(j + 1)
                run.share.used(j)
                del task, out, outs, values, leaves

    def _run_task(self, run: Run, i: int, j: int, task: Task) -> Any:
        """Task (i, j)'s forward; in turn with the other ordered tasks when j draws random numbers."""
        turn = run.turns.get((i, j))
        if turn is not None:
            run.board.wait_until(lambda: run.turn == turn)
        try:
            before = rng.capture(self.devices[j]) if (task.checkpointed or run.probing) and turn is not None else None
            task.rng_state = before if task.checkpointed else None
            tracker = _PipeSkipTracker(self, run, i, j, task, recomputing=False)
            partition = self.partitions[j]
            inputs = _inputs_of(task.leaves, copy=task.checkpointed)
            with use_skip_tracker(tracker), run.share.computing(j):
                if task.checkpointed:
                    with torch.no_grad(), enable_checkpointing():
                        out = partition(inputs[0] if task.atomic else inputs)
                else:
                    out = partition(inputs[0] if task.atomic else inputs)
            if run.probing and before is not None and not rng.same(before, rng.capture(self.devices[j])):
                run.drew[j] = True
            return out
        except BaseException as exc:
            # Recorded before the next task's turn comes (below), so that it sees the failure
            # and stops instead of running.
            run.board.fail(exc)
            raise
        finally:
            if turn is not None:
                with run.board.cond:
                    run.turn += 1
                    run.board.cond.notify_all()

    # ---------------------------------------------------------------- backward

    def backward(self, run: Run, grads: List[Tuple[Optional[Tensor], ...]]) -> List[Tuple[Optional[Tensor], ...]]:
        """Gradients of each micro-batch's inputs, given those of its outputs."""
        n = len(self.partitions)
        run.board = Board()  # the forward's board ended with that pass
        run.share = self._share()
        for i, g in enumerate(grads):
            run.board.put(("grad", i, n - 1), g)
            run.share.arrived(n - 1)
        # This thread runs every partition for one micro-batch (as FairScale's backward, which is
        # the autograd engine's, runs on the caller's thread), and always those on its own CUDA
        # device: a CUDA node runs on autograd's thread for its device, which the partitions' own
        # backward calls on that device need.
        here = next((g.device for gs in grads for g in gs if g is not None), torch.device("cpu"))
        mine = [j for j in range(n) if run.m == 1 or (here.type == "cuda" and self.devices[j] == here)]
        for j in range(n):
            if j not in mine:
                self.workers.submit(j, run.board.job(lambda j=j: self._backward_partitions(run, [j])))
        if mine:
            run.board.job(lambda: self._backward_partitions(run, mine))()
        try:
            run.board.join()
        finally:
            run.tasks.clear()
            run.release()
        return [run.board.slots.pop(("grad", i, -1)) for i in range(run.m)]

    def _backward_partitions(self, run: Run, parts: List[int]) -> None:
        n = len(self.partitions)
        # Backward clock order: cycle (m-1-i) + (n-1-j), later partitions first within a cycle.
        order = sorted(((i, j) for j in parts for i in range(run.m)), key=lambda t: (run.m - t[0] + n - t[1], -t[1]))
        with _autocast(run.autocast):
            for i, j in order:
                with self._on_device(self.devices[j]):
                    self._backward_task(run, i, j)

    def _backward_task(self, run: Run, i: int, j: int) -> None:
        device = self.devices[j]
        task = run.tasks.pop((i, j))
        if task.checkpointed:
            with run.share.computing(j):
                self._recompute(run, i, j, task)  # before the gradient arrives: overlaps later partitions
        grads = move(run.board.take(("grad", i, j)), device, self.streams, run.holds)
        tensors, grad_tensors = [], []
        for y, g in zip(task.outputs, grads):
            if g is not None and y.requires_grad:
                tensors.append(y)
                grad_tensors.append(g)
        for key, t in task.stashed.items():
            g = run.board.slots.pop(("skip_grad", i, key), None)  # the popping task has finished
            if t is not None and g is not None and t.requires_grad:
                tensors.append(t)
                (g,) = move((g,), device, self.streams, run.holds)
                grad_tensors.append(g)
        if tensors:
            with run.share.computing(j):
                torch.autograd.backward(tensors, grad_tensors)
        for key, leaf in task.popped.items():
            run.board.put(("skip_grad", i, key), None if leaf is None else leaf.grad)
        input_grads = tuple(x.grad if x.requires_grad else None for x in task.leaves)
        del task, tensors, grad_tensors
        run.board.put(("grad", i, j - 1), input_grads)
        if j > 0:
            run.share.arrived(j - 1)
        run.share.used(j)

    def _recompute(self, run: Run, i: int, j: int, task: Task) -> None:
        device = self.devices[j]
        task.stashed = {}
        replay = task.rng_state is not None and self.drawing.get(run.signature, [True] * len(self.devices))[j]
        with contextlib.ExitStack() as stack:
            if replay:
                stack.enter_context(rng.replay_lock)
                saved = rng.capture(device)
                rng.restore(task.rng_state, device)
                stack.callback(rng.restore, saved, device)
            stack.enter_context(torch.enable_grad())
            stack.enter_context(enable_recomputing())
            stack.enter_context(use_skip_tracker(_PipeSkipTracker(self, run, i, j, task, recomputing=True)))
            inputs = _inputs_of(task.leaves, copy=True)
            out = self.partitions[j](inputs[0] if task.atomic else inputs)
        task.outputs = microbatch.as_tuple(out)

    # ------------------------------------------------------------------ helpers

    def _share(self) -> ThreadShare:
        """The thread share of a pass started on this thread."""
        cpu = [d.type == "cpu" and self.share_threads for d in self.devices]
        return ThreadShare(cpu, torch.get_num_threads(), threading.get_ident())

    @contextlib.contextmanager
    def _on_device(self, device: torch.device) -> Generator[None, None, None]:
        if device.type != "cuda":
            yield
            return
        with torch.cuda.device(device), torch.cuda.stream(self.streams.compute[device]):
            yield

    def close(self) -> None:
        self.workers.close()


class PipeFunction(torch.autograd.Function):
    """The pipeline as one node of the caller's graph: forward returns the outputs already
    computed by the run; backward runs the pipeline's backward."""

    @staticmethod
    def forward(ctx: Any, pipeline: Pipeline, run: Run, input_split: List[int], phony: Tensor, *args: Tensor) -> Any:
        ctx.pipeline, ctx.run, ctx.input_split = pipeline, run, input_split
        ctx.inputs_meta = [(x.requires_grad, x.shape, x.dtype, x.device) for x in args]
        ctx.output_split = [out[0].size(0) for out in run.outputs]
        ctx.set_materialize_grads(False)
        outs = microbatch.gather(run.outputs)
        run.outputs = []
        ctx.mark_non_differentiable(*[y for y in outs if not (y.is_floating_point() or y.is_complex())])
        return outs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Any:
        run: Run = ctx.run
        if run is None:
            raise RuntimeError(
                "Pipe: backward through a Pipe's output can run once per forward (its partitions' graphs are freed "
                "by the first backward, also with retain_graph=True)"
            )
        if torch.is_grad_enabled():
            raise RuntimeError(
                "Pipe: a backward with create_graph=True (a double backward, e.g. a gradient penalty) is not "
                "supported: the partitions' backward runs without recording a graph"
            )
        per_batch: List[List[Optional[Tensor]]] = [[] for _ in range(run.m)]
        for g in grad_outputs:
            parts = [None] * run.m if g is None else list(g.split(ctx.output_split))
            for i in range(run.m):
                per_batch[i].append(parts[i])
        input_grads = ctx.pipeline.backward(run, [tuple(b) for b in per_batch])
        ctx.run = None
        result: List[Optional[Tensor]] = []
        for k, (requires_grad, shape, dtype, device) in enumerate(ctx.inputs_meta):
            pieces = [gs[k] for gs in input_grads]
            if not requires_grad or all(p is None for p in pieces):
                result.append(None)
                continue
            sizes = ctx.input_split
            pieces = [
                p if p is not None else torch.zeros((s, *shape[1:]), dtype=dtype, device=device)
                for p, s in zip(pieces, sizes)
            ]
            result.append(torch.cat([p.to(device) for p in pieces]))
        return (None, None, None, None, *result)
