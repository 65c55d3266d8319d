"""DistributedPipeline: a PipelineModulesGraph run in micro-batches on its RPC workers.

``pipe(*inputs)`` cuts the inputs into ``chunks`` micro-batches and, for every micro-batch and
partition in graph order, asks the partition's worker (``rpc.remote``) to run it on its inputs:
model inputs travel with the request, other partitions' outputs as RRefs the worker fetches. The
requests go out in that order without waiting for one another, so the workers run different
micro-batches at the same time and each waits only for its own inputs. A request waiting for its
inputs holds one of its worker's RPC threads, so the caller keeps fewer requests pending on a
worker than the worker has threads (see :func:`_request_budget`), waiting for the oldest before
sending more; every pending request's inputs come from requests sent before it, so the oldest can
always run. The last partition's worker joins the micro-batches' outputs and the call returns an
RRef to them there. Inside ``torch.distributed.autograd.context()`` every hop is recorded, so a
loss computed from that RRef (DistributedLoss) backpropagates through every worker; the first
``checkpoint_stop`` micro-batches of a training step keep only their partitions' inputs and
recompute in backward.
"""

from __future__ import annotations

from dataclasses import dataclass
import threading
from collections import defaultdict, deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn
from torch.distributed import rpc

from ....nn.pipe import microbatch
from .graph import Node, PipelineModulesGraph
from ....internal.args import as_int

Device = Union[torch.device, int, str]

MOVING_DENIED = TypeError(
    "denied to move parameters and buffers, because DistributedPipeline should manage device placement"
)


def _fetch(arg: Any, device: str) -> Tensor:
    """A partition's input: a tensor sent along, or (RRef, index) of another partition's output."""
    if isinstance(arg, tuple):
        rref, index = arg
        value = rref.to_here()
        if index is not None:
            value = value[index]
        arg = value
    return arg.to(device) if device else arg


def _run_partition(module_rref: rpc.RRef, args: List[Any], device: str, checkpointed: bool) -> Any:
    """On the partition's worker: its module on its inputs."""
    module = module_rref.local_value()
    xs = [_fetch(a, device) for a in args]
    if checkpointed and module.training and torch.is_grad_enabled():
        return torch_checkpoint.checkpoint(module, *xs, use_reentrant=False)
    return module(*xs)


def _join(rrefs: List[rpc.RRef]) -> Any:
    """On the last partition's worker: the micro-batches' outputs joined along dimension 0."""
    outs = [r.to_here() for r in rrefs]
    atomic = isinstance(outs[0], Tensor)
    joined = microbatch.gather([microbatch.as_tuple(o) for o in outs])
    return microbatch.from_tuple(joined, atomic)


# Threads of a worker's RPC pool kept free of pipeline requests (the micro-batches' and the
# joins'): the loss and its wait (DistributedLoss) may each hold one, and one must stay free to
# take the replies that wake them (TensorPipe completes them on the same pool); one spare.
_RESERVED_THREADS = 4


class _Pending:
    """Requests sent by this process and not yet finished, per worker, across pipelines (they
    share the workers' pools), for the current RPC agent only: a request of an agent that was
    shut down may never finish. One lock: threads calling pipelines at once take turns."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.agent: Any = None
        self.by_worker: Dict[str, Deque[torch.futures.Future]] = defaultdict(deque)

    def on(self, worker: str) -> Deque[torch.futures.Future]:
        agent = rpc.api._get_current_rpc_agent()
        if agent is not self.agent:
            self.agent, self.by_worker = agent, defaultdict(deque)
        return self.by_worker[worker]


_pending = _Pending()


def _pool_size() -> int:
    """On a worker: its RPC agent's thread count (TensorPipe's default, 16, where not reported)."""
    agent = rpc.api._get_current_rpc_agent()
    try:
        return int(agent.get_debug_info().get("agent.thread_pool_size", 16))
    except (AttributeError, ValueError):
        return 16


def _request_budget(worker: str, threads: int) -> int:
    """How many pipeline requests may wait at once on ``worker``, which has ``threads`` RPC threads."""
    if threads <= _RESERVED_THREADS:
        raise ValueError(
            f"DistributedPipeline: worker {worker} has {threads} RPC threads; it needs at least "
            f"{_RESERVED_THREADS + 1} (TensorPipeRpcBackendOptions(num_worker_threads=...); the default is 16)"
        )
    return threads - _RESERVED_THREADS


def _import_on(workers: Set[Union[str, int]]) -> None:
    """Import this package on each worker (a name or a rank) now, in one call: otherwise its first
    requests (run by several threads of the worker's RPC pool at once) import it concurrently,
    which Python's import lock can refuse as a deadlock."""
    for worker in sorted(workers, key=str):
        rpc.rpc_sync(worker, exec, args=(f"import {__package__}",))


def _budgets(workers: List[rpc.WorkerInfo]) -> Dict[str, int]:
    """Each worker's request budget, by worker name."""
    by_name = {w.name: w for w in workers}
    return {name: _request_budget(name, rpc.rpc_sync(w, _pool_size)) for name, w in sorted(by_name.items())}


def _send(worker: rpc.WorkerInfo, budget: int, fn: Any, args: Tuple[Any, ...]) -> rpc.RRef:
    """``rpc.remote(worker, fn, args)`` once fewer than ``budget`` requests of this process are
    pending on ``worker``, waiting for the oldest first (each wait ends by the request's RPC
    timeout). Every pending request's inputs come from requests sent before it, so the oldest can
    always run. A request's error is not raised here: it reaches the caller through the RRefs
    that depend on it (the join's, the loss's). Called with ``_pending.lock`` held."""
    pending = _pending.on(worker.name)
    while pending and (pending[0].done() or len(pending) >= budget):
        try:
            pending.popleft().wait()
        except Exception:
            pass
    rref = rpc.remote(worker, fn, args=args)
    pending.append(rref._get_future())
    return rref


def _parameter_rrefs(module_rref: rpc.RRef) -> List[rpc.RRef]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


class DistributedPipeline(nn.Module):
    """FairScale's ``DistributedPipeline(graph, chunks=1, checkpoint="except_last")``: runs a
    :class:`PipelineModulesGraph` in ``chunks`` micro-batches (see the module docstring);
    ``checkpoint`` is "always", "except_last" or "never"; ``parameter_rrefs()`` feeds a
    ``torch.distributed.optim.DistributedOptimizer``."""

    @dataclass
    class Partition:
        nodes: List[Node]
        handler: rpc.RRef  # the module that runs the partition, on its worker

        def __hash__(self) -> int:
            return id(self)

    def __init__(self, graph: PipelineModulesGraph, chunks: int = 1, checkpoint: str = "except_last") -> None:
        super().__init__()
        if not isinstance(graph, PipelineModulesGraph):
            raise TypeError(
                f"DistributedPipeline: argument 'graph' must be a PipelineModulesGraph, got {type(graph).__name__}"
            )
        if as_int(chunks) is None or chunks <= 0:
            raise ValueError("number of chunks must be positive integer")
        chunks = as_int(chunks)
        if checkpoint not in ["always", "except_last", "never"]:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.checkpoint_stop = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
        _import_on({n.module.on for n in graph.nodes})
        self.partitions = [self.Partition(nodes, rref) for nodes, rref in graph.partition_graph()]
        self._budgets = _budgets([p.handler.owner() for p in self.partitions])
        self._first_of = {id(p.nodes[0]): i for i, p in enumerate(self.partitions)}
        self._last_of = {id(p.nodes[-1]): i for i, p in enumerate(self.partitions)}
        for i, p in enumerate(self.partitions):
            for source in p.nodes[0].inputs:
                if source.producer is not None and self._last_of.get(id(source.producer), len(self.partitions)) >= i:
                    raise ValueError(
                        "DistributedPipeline: a module's inputs must come from model inputs or modules added before it"
                    )
        self.graph = graph

    # DistributedPipeline places every partition: no moves of the whole.
    def cuda(self, device: Optional[Device] = None) -> "DistributedPipeline":
        raise MOVING_DENIED

    def cpu(self) -> "DistributedPipeline":
        raise MOVING_DENIED

    def to(self, *args: Any, **kwargs: Any) -> "DistributedPipeline":
        if "device" in kwargs or "tensor" in kwargs:
            raise MOVING_DENIED
        if args and (isinstance(args[0], (torch.device, int, str)) or torch.is_tensor(args[0])):
            raise MOVING_DENIED
        return super().to(*args, **kwargs)

    def parameter_rrefs(self) -> List[rpc.RRef]:
        """RRefs to every partition's parameters (for DistributedOptimizer)."""
        out: List[rpc.RRef] = []
        for p in self.partitions:
            out.extend(rpc.rpc_sync(p.handler.owner(), _parameter_rrefs, args=(p.handler,)))
        return out

    def forward(self, *inputs: Tensor) -> rpc.RRef:  # type: ignore[override]
        """An RRef, on the last partition's worker, to the model's output for ``inputs``."""
        for i, x in enumerate(inputs):
            if not isinstance(x, Tensor):
                raise TypeError(f"DistributedPipeline: input {i} must be a Tensor, got {type(x).__name__}")
        scattered = [microbatch.scatter(x, self.chunks) for x in inputs]
        count = len(scattered[0]) if scattered else 1
        if any(len(s) != count for s in scattered):
            raise ValueError("DistributedPipeline: the inputs split into different numbers of micro-batches")
        finals = []
        with _pending.lock:
            for j in range(count):
                outputs: List[rpc.RRef] = []
                for p in self.partitions:
                    args = [self._argument(source, scattered, outputs, j) for source in p.nodes[0].inputs]
                    device = str(p.nodes[0].module.device) if p.nodes[0].module.device is not None else ""
                    checkpointed = j < self.checkpoint_stop
                    worker = p.handler.owner()
                    request = (p.handler, args, device, checkpointed)
                    outputs.append(_send(worker, self._budgets[worker.name], _run_partition, request))
                finals.append(outputs[-1])
            last = self.partitions[-1].handler.owner()
            return _send(last, self._budgets[last.name], _join, (finals,))

    def _argument(
        self, source: Any, scattered: Sequence[List[Tuple[Tensor, ...]]], outputs: List[rpc.RRef], j: int
    ) -> Any:
        if source.producer is None:
            if source.output_idx >= len(scattered):
                raise ValueError(f"DistributedPipeline: model input {source.output_idx} was not given")
            return scattered[source.output_idx][j][0]
        index = self._last_of[id(source.producer)]
        element = source.output_idx if source.producer.num_outputs is not None else None
        return (outputs[index], element)
