"""AsyncPipe: FairScale's multi-process pipeline, one partition per rank of a process group.

Every rank of the pipeline group builds ``AsyncPipe(module, balance, group=...)`` and keeps only
its own partition (``balance[rank]`` consecutive layers; a list of LazyModules is realised only
where it is kept). Every rank then calls ``pipe(batch)`` with a batch of the same size, which is
cut into ``chunks`` micro-batches:

- the first stage runs its partition on its micro-batches and sends each result on;
- a middle stage receives each micro-batch, runs its partition and sends the result on;
- the last stage receives, runs, and returns the micro-batches' outputs joined into one batch,
  connected to autograd: the caller's ``loss.backward()`` sends each micro-batch's input
  gradient back.

In training (module in training mode and autograd on), the first and middle stages stay inside
``forward`` until every micro-batch's gradient has come back and gone through their partition
(sending theirs on back), as in FairScale; they return the micro-batches they were given, and
``back_helper`` is a no-op there. The first ``checkpoint_stop`` micro-batches ("always": all,
"except_last": all but the last, "never": none) are checkpointed: their activations are kept
only at the partition's input and recomputed in backward.

Transport: fairscale_c.distributed point-to-point between neighbouring ranks (the shared-memory
engine for CPU tensors, NCCL for CUDA ones): a small header (kind, micro-batch, and each tensor's
device type, dtype and shape) and then the tensors, activations forward and gradients back, each direction
one ordered stream. A rank that dies raises DistributedError on the others within the engine's
timeout; so does a last stage whose caller never runs backward in training mode.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

from ... import distributed as fdist
from ..checkpoint.checkpoint_activations import enable_checkpointing, enable_recomputing
from . import microbatch
from .batchnorm import DeferredBatchNorm, begin_mini_batch
from .skip.skippable import Skippable
from .types import LazyModule
from ...internal.args import as_int

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]

ACTIVATIONS, GRADIENTS = 1, 2  # the kinds of message between stages
_HEADER = 256  # int64 entries in a message header
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
_Meta = Tuple[torch.dtype, List[int], bool]  # dtype, shape, sent from a CUDA tensor


def verify_module(module: Union[nn.Sequential, List[Any]]) -> None:
    if not isinstance(module, (nn.Sequential, list)):
        raise TypeError(f"module must be nn.Sequential or a list of LazyModule, got {type(module).__name__}")
    if len(set(map(id, module))) != len(module):
        raise ValueError("module with duplicate children is not supported")


def check_balance(module: Union[nn.Sequential, List[Any]], balance: List[int]) -> None:
    if len(module) != sum(balance):
        raise ValueError(
            f"module and sum of balance have different length (module: {len(module)}, sum of balance: {sum(balance)})"
        )
    if any(x <= 0 for x in balance):
        raise ValueError(f"all balance numbers must be positive integer (balance: {balance})")


class AsyncPipe(nn.Module):
    """FairScale's ``AsyncPipe(module, balance, *, group=None, worker_map=None, input_device=None,
    chunks=1, checkpoint="except_last", deferred_batch_norm=False)``.

    group: the pipeline's process group (default: model_parallel's pipeline group); stage i is
    its rank i. worker_map: accepted for FairScale's signature; unused (no RPC here).
    input_device: where received activations are placed (default: the partition's device; for a
    partition without parameters, the device type they were sent from).
    See the module docstring for how a step runs."""

    balance: List[int] = []
    chunks: int = 1
    checkpoint: str = "except_last"

    def __init__(
        self,
        module: Union[nn.Sequential, List[LazyModule]],
        balance: Iterable[int],
        *,
        group: Optional[Any] = None,
        worker_map: Optional[Dict[int, str]] = None,
        input_device: Union[None, int, str, torch.device] = None,
        chunks: int = chunks,
        checkpoint: str = checkpoint,
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if as_int(chunks) is None or chunks <= 0:
            raise ValueError("number of chunks must be positive integer")
        chunks = as_int(chunks)
        if checkpoint not in ["always", "except_last", "never"]:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
        self.balance = [int(b) for b in balance]
        verify_module(module)
        check_balance(module, self.balance)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.worker_map = worker_map
        # a forward that raises gives up on the group (StageStep.run); PipeRPCWrapper turns it off
        self.give_up_on_error = True
        self.input_device = torch.device(input_device) if input_device is not None else None
        self.lock = threading.Lock()
        if group is None:
            from ..model_parallel import get_pipeline_parallel_group

            group = get_pipeline_parallel_group()
        self.group = group
        size, rank = group.size(), group.rank()
        if size < len(self.balance):
            raise IndexError(f"too few ranks to hold given partitions (ranks: {size}, partitions: {len(self.balance)})")
        comm = fdist.group_for(group, argument="AsyncPipe: argument 'group'")
        self.stage = rank
        self.final_stage = rank == len(self.balance) - 1
        self.partition: Optional[nn.Sequential] = None
        self.partitions: List[nn.Sequential] = []
        self.pipeline: Optional[AsyncPipeline] = None
        if rank >= len(self.balance):
            warnings.warn("More ranks than partitions, some ranks unused", stacklevel=2)
        else:
            self.pipeline = AsyncPipeline(comm)
            start = sum(self.balance[:rank])
            part = _instantiate(module, start, start + self.balance[rank])
            if deferred_batch_norm:
                part = DeferredBatchNorm.convert_deferred_batch_norm(part, chunks)
            self.add_module("0", part)
            self.partition = part
            self.partitions = [part]
        del module

    # ------------------------------------------------------------------ the Sequential protocol
    def __len__(self) -> int:
        """The number of layers in this rank's partition."""
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        """A layer of this rank's partition."""
        if self.partition is None:
            raise IndexError(index)
        return self.partition[index]

    def __iter__(self) -> Iterator[nn.Module]:
        for p in self.partitions:
            yield from p

    # ------------------------------------------------------------------ a step
    def forward(self, input: TensorOrTensors, *, event: Any = None) -> Any:  # type: ignore[override]
        """This stage's part of a pipelined step on ``input`` (a Tensor or a tuple of Tensors,
        the same size on every rank): the output on the last stage, the micro-batches elsewhere."""
        microbatch.check(input)
        if self.partition is None:
            return input
        batches = microbatch.scatter(input, self.chunks)
        with self.lock:
            begin_mini_batch(self.partition, len(batches))
            return StageStep(self, batches, isinstance(input, Tensor)).run()

    def back_helper(self, output: Any) -> None:
        """FairScale's: nothing to do here (the first and middle stages' backward runs inside
        forward); an error on the last stage, whose backward is its caller's."""
        if self.final_stage:
            raise ValueError("back_helper should only be called on non-final stages")

    @property
    def checkpoint_stop(self) -> int:
        """Micro-batches with an index below this are checkpointed (0 outside training)."""
        if not self.training:
            return 0
        return {"always": self.chunks, "except_last": self.chunks - 1, "never": 0}[self.checkpoint]

    def _device(self) -> Optional[torch.device]:
        """Where received activations go: ``input_device``, else the partition's parameters' device;
        None for a partition without parameters (they stay on the device they were sent from)."""
        if self.input_device is not None:
            return self.input_device
        first = next(self.partition.parameters(), None) if self.partition is not None else None
        return first.device if first is not None else None


class AsyncPipeline:
    """What a rank holding a partition runs its stage with (None on ranks beyond the partitions,
    as FairScale's ``pipeline``): the engine group the stages talk through."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm


def _instantiate(module: Union[nn.Sequential, List[Any]], start: int, end: int) -> nn.Sequential:
    """Layers [start, end) of ``module`` as an nn.Sequential (LazyModules realised here only)."""
    if isinstance(module, nn.Sequential):
        named = list(module.named_children())[start:end]
    else:
        named = [(str(i), module[i]) for i in range(start, end)]
    layers: "OrderedDict[str, nn.Module]" = OrderedDict()
    for name, layer in named:
        if not isinstance(layer, nn.Module):
            if not callable(layer):
                raise TypeError(f"layer must be nn.Module or callable, is {type(layer)}")
            layer = layer()
        if isinstance(layer, Skippable):
            raise ValueError("AsyncPipe does not support skip connections (Skippable layers); use Pipe")
        layers[str(name)] = layer
    return nn.Sequential(layers)


class StageStep:
    """One call of AsyncPipe.forward on this rank: the messages to and from the neighbouring
    stages and the partition's compute (AMPnetPipe drives the same pieces with its schedule)."""

    def __init__(self, pipe: AsyncPipe, batches: List[Tensors], atomic: bool) -> None:
        self.pipe = pipe
        self.batches = batches
        self.atomic = atomic
        self.comm = pipe.pipeline.comm
        self.stage = pipe.stage
        self.train = pipe.training and torch.is_grad_enabled()
        self.stop = pipe.checkpoint_stop if self.train else 0
        self.device = pipe._device()

    def run(self) -> Any:
        try:
            return self._run()
        except BaseException:
            # the other stages would wait out FAIRSCALE_C_TIMEOUT for this one's messages
            if self.pipe.give_up_on_error:
                self.comm.abort()
            raise

    def _run(self) -> Any:
        outputs: List[Tensors] = []
        out_atomic = True
        for i, batch in enumerate(self.batches):
            if self.stage == 0:
                xs, in_atomic = batch, self.atomic
                if self.train and len(self.batches) > 1:
                    # micro-batches of one batch share its version counter: an in-place op on one
                    # would invalidate what another saved for backward. Copies do not.
                    xs = tuple(x.clone() for x in xs)
            else:
                xs, in_atomic = self.receive_activations(i)
            ys = self.compute(xs, in_atomic, i)
            out_atomic = isinstance(ys, Tensor)
            ys = microbatch.as_tuple(ys)
            if not self.pipe.final_stage:
                self.send(ACTIVATIONS, i, [y.detach() for y in ys], out_atomic, self.stage + 1)
            outputs.append(ys)
        if self.pipe.final_stage:
            return microbatch.from_tuple(microbatch.gather(outputs), out_atomic)
        if self.train:
            self.backward(outputs)
        return self.batches

    def compute(self, xs: Tensors, atomic: bool, index: int) -> TensorOrTensors:
        partition = self.pipe.partition
        arg: Any = xs[0] if atomic else xs
        if index >= self.stop:
            out = partition(arg)
            microbatch.check(out, "a partition's output")
            return out
        passes: List[None] = []

        def run(*inputs: Tensor) -> TensorOrTensors:
            first = not passes
            passes.append(None)
            # the checkpoint keeps its inputs for the recomputation: the partition gets copies, so
            # that it may begin with an in-place op
            inputs = tuple(x.clone() if x.is_floating_point() or x.is_complex() else x for x in inputs)
            with enable_checkpointing() if first else enable_recomputing():
                return partition(inputs[0] if atomic else inputs)

        out = torch_checkpoint.checkpoint(run, *xs, use_reentrant=False)
        microbatch.check(out, "a partition's output")
        return out

    def backward(self, outputs: List[Tensors]) -> None:
        """Receive each micro-batch's output gradients from the next stage (in whatever order it
        sends them) and run the backward of that micro-batch."""
        for _ in range(len(outputs)):
            kind, index, _, metas = self.receive_header(self.stage + 1)
            if kind != GRADIENTS or not 0 <= index < len(outputs):
                raise fdist.DistributedError(
                    f"AsyncPipe stage {self.stage}: expected gradients from stage {self.stage + 1}, got a message "
                    f"of kind {kind} for micro-batch {index}"
                )
            grads = self.receive_tensors(metas, self.stage + 1, [y.device for y in outputs[index]])
            pairs = [(y, g) for y, g in zip(outputs[index], grads) if g is not None and y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
            outputs[index] = ()

    # ------------------------------------------------------------------ messages
    def receive_activations(self, index: int) -> Tuple[Tensors, bool]:
        if not self.train:
            kind, got, atomic, metas = self.receive_header(self.stage - 1)
            self.check_activations(kind, got, index)
            return tuple(t for t in self.receive_tensors(metas, self.stage - 1) if t is not None), atomic
        phony = torch.empty(0, requires_grad=True)
        meta: Dict[str, Any] = {}
        xs = _Receive.apply(phony, self, index, meta)
        return tuple(xs), meta["atomic"]

    def check_activations(self, kind: int, got: int, index: int) -> None:
        if kind != ACTIVATIONS or got != index:
            raise fdist.DistributedError(
                f"AsyncPipe stage {self.stage}: expected the activations of micro-batch {index} from stage "
                f"{self.stage - 1}, got a message of kind {kind} for micro-batch {got}"
            )

    def send(self, kind: int, index: int, tensors: Sequence[Optional[Tensor]], atomic: bool, peer: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        fields = [kind, index, int(atomic), len(tensors)]
        for t in tensors:
            if t is None:
                fields += [0]
            else:
                if t.dtype not in _DTYPES:
                    raise TypeError(f"AsyncPipe: cannot send a {t.dtype} tensor between stages")
                # 1 for a host tensor, 2 for a CUDA one: the receive goes by the same route
                fields += [2 if t.is_cuda else 1, _DTYPES.index(t.dtype), t.dim(), *t.shape]
        if len(fields) > _HEADER:
            raise ValueError(f"AsyncPipe: too many tensors or dimensions to describe in one message ({len(fields)})")
        header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        self.comm.send(header, peer)
        for t in tensors:
            if t is not None and t.numel():
                self.comm.send(_wire(t), peer)

    def receive_header(self, peer: int) -> Tuple[int, int, bool, List[Optional[_Meta]]]:
        header = torch.empty(_HEADER, dtype=torch.int64)
        self.comm.recv(header, peer)
        f = header.tolist()
        kind, index, atomic, n = f[0], f[1], bool(f[2]), f[3]
        metas: List[Optional[_Meta]] = []
        pos = 4
        for _ in range(n):
            if f[pos] == 0:
                metas.append(None)
                pos += 1
                continue
            dtype, ndim = _DTYPES[f[pos + 1]], f[pos + 2]
            metas.append((dtype, f[pos + 3 : pos + 3 + ndim], f[pos] == 2))
            pos += 3 + ndim
        return kind, index, atomic, metas

    def receive_tensors(
        self, metas: Sequence[Optional[_Meta]], peer: int, to: Sequence[Optional[torch.device]] = ()
    ) -> List[Optional[Tensor]]:
        """The tensors ``metas`` describe, each received on a device of the sender's type (the
        route, host or NCCL, must be the same on both sides) and then moved to ``to[i]`` if given,
        else to the stage's device if it has one."""
        out: List[Optional[Tensor]] = []
        for i, meta in enumerate(metas):
            if meta is None:
                out.append(None)
                continue
            dtype, shape, cuda = meta
            want = to[i] if i < len(to) else self.device
            if want is not None and want.type == ("cuda" if cuda else "cpu"):
                device = want
            else:
                device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            t = torch.empty(shape, dtype=dtype, device=device)
            if t.numel():
                self.comm.recv(_wire(t), peer)
            out.append(t if want is None or want == device else t.to(want))
        return out


_ON_THE_WIRE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)


def _wire(t: Tensor) -> Tensor:
    """``t`` (contiguous) as the engine's point-to-point takes it: itself, or its bytes for the
    dtypes it does not (bool, int8, int16, complex) — a view, so a receive fills ``t``."""
    t = t.contiguous()
    return t if t.dtype in _ON_THE_WIRE else t.reshape(-1).view(torch.uint8)


class _Receive(torch.autograd.Function):
    """Receives a micro-batch's activations from the previous stage; its backward sends their
    gradients back there."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, step: StageStep, index: int, meta: Dict[str, Any]) -> Tensors:  # type: ignore[override]
        kind, got, atomic, metas = step.receive_header(step.stage - 1)
        step.check_activations(kind, got, index)
        xs = [t for t in step.receive_tensors(metas, step.stage - 1) if t is not None]
        meta["atomic"] = atomic
        ctx.step, ctx.index = step, index
        ctx.mark_non_differentiable(*[x for x in xs if not (x.is_floating_point() or x.is_complex())])
        return tuple(xs)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[None, ...]:
        step = ctx.step
        wanted = [g if g is not None and (g.is_floating_point() or g.is_complex()) else None for g in grads]
        step.send(GRADIENTS, ctx.index, wanted, False, step.stage - 1)
        return (None, None, None, None)


__all__ = ["AsyncPipe", "AsyncPipeline", "StageStep", "ACTIVATIONS", "GRADIENTS", "verify_module", "check_balance"]
