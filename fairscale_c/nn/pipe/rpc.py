"""PipeRPCWrapper: FairScale's way to drive an AsyncPipe from one process over torch RPC.

Rank 0 of the pipeline group builds ``PipeRPCWrapper(module, balance, **AsyncPipe's keywords)``
and runs the training loop; every other rank of the group has joined torch RPC and waits in
``rpc.shutdown()``. The wrapper builds the AsyncPipe on rank 0 and, over RPC, on every other rank
of the group (the module travels pickled, as in FairScale), so each rank keeps its own partition.

A call ``wrapper(batch)`` on rank 0 asks every stage over RPC to run its part of the AsyncPipe
step, runs stage 0 itself on a thread of its own, and returns the last stage's output on rank 0.
Activations and gradients between stages go through the AsyncPipe's own point-to-point
(fairscale_c.distributed); only the last stage's output and its gradient travel over RPC. In
training, ``loss.backward()`` on rank 0 sends the output's gradient to the last stage, whose
backward flows back through the stages, and returns once every stage's backward has finished, so
that the gradients are in place when ``foreach_worker`` steps the optimizers.

``foreach_worker(callback, ctx, include_self=False)`` runs ``callback(ctx, model)`` with each
rank's AsyncPipe (the callback must be picklable: a module-level function).

What differs from FairScale 0.4.13 (whose wrapper needs CUDA and MPI-launched tests):
- it runs on CPU ranks too: partitions stay where the module's layers are, unless
  ``input_device`` is a CUDA device, in which case every rank moves its partition to its current
  CUDA device (FairScale always does);
- an error in a stage, or in a ``foreach_worker`` callback, is raised on rank 0 (FairScale prints
  it on the worker and goes on); an RPC waits at most FAIRSCALE_C_TIMEOUT seconds;
- ``loss.backward()`` returns after the whole pipeline's backward (FairScale's returns once the
  gradient is sent, so an optimizer step right after may race the stages' backward);
- the ranks run the step in the caller's grad mode as well as its training mode;
- ``group`` may be the pipeline group (the default) or the default group (``WORLD``), the two
  groups every rank can name; FairScale takes the pipeline group only;
- without ``worker_map``, the RPC worker with id ``r`` serves global rank ``r``.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import rpc

from ... import distributed as fdist
from . import microbatch
from .async_pipe import AsyncPipe
from .worker import _loop as run_jobs

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]

_PIPELINE, _WORLD = "pipeline", "world"  # how a rank names the wrapper's group
_models: Dict[Tuple[int, int], AsyncPipe] = {}  # this process's stages, by wrapper key
_results: Dict[Tuple[int, int], Tuple[Tensor, ...]] = {}  # a last stage's outputs awaiting their backward
_keys = itertools.count()


def _group(kind: str) -> Any:
    if kind == _WORLD:
        return dist.group.WORLD
    from ..model_parallel import get_pipeline_parallel_group

    return get_pipeline_parallel_group()


def _pipeline_initialised() -> bool:
    from ..model_parallel import model_parallel_is_initialized

    return model_parallel_is_initialized()


def _device_scope(model: AsyncPipe) -> Any:
    """Makes the model's CUDA device current on this thread (RPC threads start on device 0)."""
    device = model._device()
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _host(t: Tensor) -> Tensor:
    """``t`` detached, on the host (what RPC carries without a device map)."""
    return t.detach().cpu() if t.is_cuda else t.detach()


class _Worker:
    """The thread that runs a stage's work, one per stage and kept between steps: on rank 0 the
    stage's step; on the other ranks everything RPC asks of the stage (RPC's handler threads
    change from call to call). Torch sets up per-thread state on a thread's first operators, which
    a new thread per step would pay at every step."""

    def __init__(self) -> None:
        self.jobs: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        # the job loop drops each job once run: what it holds (tensors, the model) must not be freed
        # on this thread later, at exit, while the interpreter shuts down
        self.thread = threading.Thread(target=run_jobs, args=(self.jobs,), name="PipeRPCWrapper stage", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the worker; its result or its exception here. Waits at most
        FAIRSCALE_C_TIMEOUT seconds."""
        done = threading.Event()
        box: List[Any] = [None, None]

        def job() -> None:
            try:
                box[0] = fn()
            except BaseException as exc:  # noqa: BLE001 (raised on the calling thread)
                box[1] = exc
            finally:
                done.set()

        self.jobs.put(job)
        timeout = fdist.timeout_s()
        if not done.wait(timeout):
            raise fdist.DistributedError(f"PipeRPCWrapper: a stage's work did not finish within {timeout:g} s")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def close(self) -> None:
        """Ends the thread once its queued jobs have run; waits for it (at most a few seconds)
        unless called on it."""
        self.jobs.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join(5.0)


_workers: Dict[Tuple[int, int], _Worker] = {}  # the threads of this process's stages, by wrapper key


def _build(key: Tuple[int, int], kind: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    """On a rank other than 0: this rank's stage of the wrapper ``key``."""
    kwargs = dict(kwargs)
    device = kwargs.get("input_device")
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        kwargs["input_device"] = torch.device("cuda", torch.cuda.current_device())
    model = AsyncPipe(*args, group=_group(kind), **kwargs)
    model.give_up_on_error = False  # the wrapper reports a stage's error to rank 0 and goes on
    if cuda:
        model.to(kwargs["input_device"])
    _models[key] = model
    _workers[key] = _Worker()


def _release(key: Tuple[int, int]) -> None:
    """On a rank other than 0: forgets the stage of a wrapper that is gone."""
    _models.pop(key, None)
    _results.pop(key, None)
    worker = _workers.pop(key, None)
    if worker is not None:
        worker.close()


def _forward(
    key: Tuple[int, int], training: bool, grad: bool, metas: List[Tuple[torch.Size, torch.dtype]], atomic: bool
) -> Optional[Tuple[bool, List[Tensor]]]:
    """On a rank other than 0: this stage's part of one step. The stage's input is only a batch
    of the right sizes (it receives its activations); the last stage returns whether its output
    is one Tensor, and the output's tensors (on the host, detached), and keeps them for the
    backward."""
    model = _models[key]

    def run() -> Optional[Tuple[bool, List[Tensor]]]:
        with _device_scope(model):
            device = model._device() or torch.device("cpu")
            batch = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas)
            model.train(training)
            with torch.set_grad_enabled(grad):
                out = model(batch[0] if atomic else batch)
            if not model.final_stage:
                return None
            outs = out if isinstance(out, tuple) else (out,)
            if training and grad:
                _results[key] = outs
            return isinstance(out, Tensor), [_host(o) for o in outs]

    return _workers[key].call(run)


def _backward(key: Tuple[int, int], grads: Sequence[Optional[Tensor]]) -> None:
    """On the last stage: the backward of the kept outputs with the gradients rank 0 computed."""
    model = _models[key]

    def run() -> None:
        outs = _results.pop(key)
        pairs = [(o, g.to(o.device)) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            with _device_scope(model):
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    _workers[key].call(run)


def _call(key: Tuple[int, int], callback: Callable[[Any, AsyncPipe], None], ctx: Any) -> None:
    model = _models[key]

    def run() -> None:
        with model.lock, _device_scope(model):
            callback(ctx, model)

    _workers[key].call(run)


class _Step:
    """One call of the wrapper on rank 0: the RPCs to the other stages and stage 0's job."""

    def __init__(self) -> None:
        self.futures: List[Any] = []
        self.stage0: Optional[threading.Event] = None  # set when stage 0's job has ended
        self.error: Optional[BaseException] = None
        self.changed = threading.Event()

    def watch(self, fut: Any) -> Any:
        changed = self.changed  # not self: torch's future would keep the step alive through it
        fut.add_done_callback(lambda _: changed.set())
        self.futures.append(fut)
        return fut

    def start(self, worker: _Worker, model: AsyncPipe, batch: TensorOrTensors, grad: bool) -> None:
        done = self.stage0 = threading.Event()

        def run() -> None:
            try:
                with torch.set_grad_enabled(grad), _device_scope(model):
                    model(batch)
            except BaseException as exc:  # noqa: BLE001 (raised on the caller's thread)
                self.error = exc
            finally:
                done.set()
                self.changed.set()

        worker.jobs.put(run)

    def check(self) -> None:
        """Raises the first error of stage 0 or of a finished RPC."""
        if self.error is not None:
            raise self.error
        for fut in self.futures:
            if fut.done():
                fut.wait()

    def wait_for(self, fut: Any, what: str) -> Any:
        """``fut``'s value; raises at once when another part of the step fails first, and
        DistributedError after FAIRSCALE_C_TIMEOUT seconds."""
        timeout = fdist.timeout_s()
        while not fut.done():
            self.changed.clear()
            self.check()
            if fut.done():
                break
            if not self.changed.wait(timeout):
                raise fdist.DistributedError(f"PipeRPCWrapper: {what} did not finish within {timeout:g} s")
        return fut.wait()

    def finish(self) -> None:
        """Waits for every stage's part of the step and raises the first error."""
        timeout = fdist.timeout_s()
        for fut in self.futures:
            self.wait_for(fut, "a stage")
        if self.stage0 is not None and not self.stage0.wait(timeout):
            raise fdist.DistributedError(f"PipeRPCWrapper: stage 0 did not finish within {timeout:g} s")
        self.check()


class _FromLastStage(torch.autograd.Function):
    """The last stage's outputs on rank 0; the backward sends their gradients to the last stage
    and waits for every stage's backward."""

    @staticmethod
    def forward(
        ctx: Any, phony: Tensor, wrapper: "PipeRPCWrapper", step: _Step, outs: List[Tensor]
    ) -> Tuple[Tensor, ...]:  # type: ignore[override]
        ctx.wrapper, ctx.step = wrapper, step
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[None, ...]:
        wrapper, step = ctx.wrapper, ctx.step
        ctx.wrapper = ctx.step = None  # the graph node outlives the step: it must not keep the wrapper
        host = [None if g is None else _host(g) for g in grads]
        last = wrapper._rpc_name(len(wrapper.model.balance) - 1)
        fut = step.watch(rpc.rpc_async(last, _backward, args=(wrapper._key, host), timeout=fdist.timeout_s()))
        step.wait_for(fut, "the last stage's backward")
        step.finish()
        wrapper._pending = None
        return (None, None, None, None)


class PipeRPCWrapper(nn.Module):
    """FairScale's ``PipeRPCWrapper(*args, **kwargs)``: ``AsyncPipe(*args, **kwargs)`` controlled
    from rank 0 of the pipeline group. See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        kind = _PIPELINE
        group = kwargs.pop("group", None)
        if group is not None and group is dist.group.WORLD:
            kind = _WORLD
        elif group is not None and (not _pipeline_initialised() or group is not _group(_PIPELINE)):
            raise ValueError(
                "group must be the pipeline parallel group (get_pipeline_parallel_group()) or the default "
                "group: the other ranks cannot be handed another group over RPC"
            )
        self.group = _group(kind)
        if self.group.rank() != 0:
            raise ValueError(
                f"PipeRPCWrapper is built on rank 0 of its pipeline group (this is rank {self.group.rank()}); "
                "the other ranks join torch RPC and wait in rpc.shutdown()"
            )
        if not rpc.is_available() or not rpc.api._is_current_rpc_agent_set():
            raise RuntimeError(
                "PipeRPCWrapper needs torch RPC: call torch.distributed.rpc.init_rpc on every rank first"
            )
        self.lock = threading.Lock()
        self.worker_map: Optional[Dict[int, str]] = kwargs.get("worker_map")
        device = kwargs.get("input_device")
        self._key = (dist.get_rank(), next(_keys))
        self._pending: Optional[_Step] = None
        names = [self._rpc_name(r) for r in range(1, self.group.size())]
        # every rank builds at once: the stages' engine group forms across them. Arguments that
        # fail here fail the same way on the other ranks, before they wait for anyone.
        building = self._start(_build, (self._key, kind, args, kwargs), names)
        try:
            self.model = AsyncPipe(*args, group=self.group, **kwargs)
            self.model.give_up_on_error = False
        except BaseException:
            try:
                building.finish()
            except Exception:  # noqa: BLE001 (the same error, raised on the other ranks)
                pass
            raise
        building.finish()
        if device is not None and torch.device(device).type == "cuda":
            self.model.to(torch.device(device))
        self._worker = _Worker()
        weakref.finalize(self, _forget, self._key, self._worker, names)

    # ------------------------------------------------------------------ RPC
    def _rpc_name(self, rank: int) -> str:
        """The RPC worker serving ``rank`` of the group."""
        global_rank = dist.get_global_rank(self.group, rank)
        if self.worker_map is not None:
            if global_rank not in self.worker_map:
                raise ValueError(f"worker_map has no worker for global rank {global_rank}")
            return self.worker_map[global_rank]
        return _worker_name(global_rank)

    @staticmethod
    def _start(fn: Callable[..., None], args: Tuple[Any, ...], names: Sequence[str]) -> _Step:
        step = _Step()
        for name in names:
            step.watch(rpc.rpc_async(name, fn, args=args, timeout=fdist.timeout_s()))
        return step

    def foreach_worker(
        self, callback: Callable[[Any, AsyncPipe], None], ctx: Any = None, *, include_self: bool = False
    ) -> None:
        """Calls ``callback(ctx, model)`` on every other rank of the group with its AsyncPipe
        (holding the model's lock), and on this rank too with ``include_self``, all at once; returns
        when every call has. An error in any call is raised here."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        names = [self._rpc_name(r) for r in range(1, self.group.size())]
        remote = self._start(_call, (self._key, callback, ctx), names)
        try:
            if include_self:  # while the other ranks run theirs
                with self.model.lock:
                    callback(ctx, self.model)
        finally:
            remote.finish()

    # ------------------------------------------------------------------ a step
    @property
    def final_stage(self) -> bool:
        return self.model.final_stage

    def forward(self, tensor: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """The pipeline's output for ``tensor`` (a Tensor or a tuple of Tensors), on rank 0."""
        microbatch.check(tensor)
        if self._pending is not None:
            raise RuntimeError(
                "PipeRPCWrapper: the previous training step's backward has not run; call backward on its "
                "output (or run the forward under torch.no_grad() or in eval mode) before the next step"
            )
        if self.model.final_stage:
            return self.model(tensor)
        atomic = isinstance(tensor, Tensor)
        batch = (tensor,) if atomic else tuple(tensor)
        metas = [(t.shape, t.dtype) for t in batch]
        training, grad = self.model.training, torch.is_grad_enabled()
        stages = len(self.model.balance)
        step = _Step()
        last = None
        for rank in range(1, stages):
            fut = step.watch(
                rpc.rpc_async(
                    self._rpc_name(rank), _forward, args=(self._key, training, grad, metas, atomic),
                    timeout=fdist.timeout_s(),
                )
            )  # fmt: skip
            if rank == stages - 1:
                last = fut
        step.start(self._worker, self.model, tensor, grad)
        out_atomic, outs = step.wait_for(last, "the last stage's forward")
        device = self.model.input_device if self.model.input_device is not None else batch[0].device
        if not (training and grad):
            step.finish()
            outs = [o.to(device) for o in outs]
            return outs[0] if out_atomic else tuple(outs)
        self._pending = step
        phony = torch.empty(0, requires_grad=True)
        # The node that waits for every stage's backward takes the outputs on the host, and the
        # copy to the device comes after it: its backward then runs on the thread that called
        # backward. On a CUDA output it would run on torch's autograd thread for that device, the
        # thread that stage 0's backward, on this rank's stage thread, needs to finish.
        result = tuple(o.to(device) for o in _FromLastStage.apply(phony, self, step, outs))
        return result[0] if out_atomic else result


def _forget(key: Tuple[int, int], worker: _Worker, names: Sequence[str]) -> None:
    """A wrapper is gone: its thread on rank 0 ends, and the other ranks drop its stage (unless
    RPC has already shut down)."""
    worker.close()
    for name in names:
        try:
            rpc.rpc_async(name, _release, args=(key,))
        except Exception:  # noqa: BLE001 (RPC shut down first: the processes are ending)
            pass


def _worker_name(global_rank: int) -> str:
    """The name of the RPC worker whose id is ``global_rank``."""
    agent = rpc.api._get_current_rpc_agent()
    for info in agent.get_worker_infos():
        if info.id == global_rank:
            return info.name
    raise ValueError(f"no RPC worker has id {global_rank}; pass worker_map={{global rank: RPC name}}")


__all__ = ["PipeRPCWrapper"]
