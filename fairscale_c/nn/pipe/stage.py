"""PipelineStage: one stage of a pipeline whose stages run in separate processes.

Stage ``i`` runs on rank ``i`` of a pipeline group (a torch.distributed process group or a
``fairscale_c.distributed`` group), or on rank ``i % size`` when an interleaved pipeline has
several stages per rank. Activations travel forward and gradients backward through the
group's point-to-point batches (CPU tensors on the shared-memory engine, CUDA tensors on NCCL). A
schedule (:class:`~fairscale_c.nn.pipe.schedule.ScheduleGPipe`, :class:`~fairscale_c.nn.pipe.schedule.Schedule1F1B`,
:class:`~fairscale_c.nn.pipe.schedule.ScheduleInterleaved1F1B`,
:class:`~fairscale_c.nn.pipe.schedule.ScheduleLoopedBFS`) decides the order of the micro-batches; the
stage knows how to run one micro-batch forward or backward and which messages that needs.

At the first step every stage takes part in a set-up: stage 0 describes each of its
micro-batches (they may differ in size when the batch does not divide evenly), each stage infers
the shapes of its outputs for each distinct input (on the meta device when the module allows it)
and sends the table to the next stage, which compares its first micro-batch with the
``input_args`` it was given. Every rank then learns every stage's verdict, so a shape mismatch or
a module that fails on its inputs is the same ``ValueError`` on every rank instead of a hang. The
receive buffers of every later step are sized from that table: no message carries shapes in the
steady state.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ... import distributed as fdist
from .pipeline import _inputs_of

# dtypes a stage may pass to the next one (what the collectives layer moves)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
           torch.int16, torch.int8, torch.bool)  # fmt: skip
_MAX_TENSORS = 8  # tensors a stage may pass on
_MAX_DIMS = 8  # dimensions per tensor
# set-up record, int64: [status, count, then per tensor (dtype index, ndim, dims... padded)]
_REC_LEN = 2 + _MAX_TENSORS * (2 + _MAX_DIMS)
_MSG_BYTES = 480  # a stage's set-up verdict as UTF-8 text (empty: fine)
_OK, _UPSTREAM_FAILED = 0, 1


def _copy_view(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) and x._is_view() else x


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor passed between stages (per micro-batch)."""

    shape: Tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)}"

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point


def describe(metas: Sequence[TensorMeta]) -> str:
    return "(" + ", ".join(str(m) for m in metas) + ")"


def _is_shape(x: Any) -> bool:
    return isinstance(x, torch.Size) or (
        isinstance(x, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in x)
    )


def metas_of(args: Any, what: str) -> Tuple[TensorMeta, ...]:
    """Metadata of a sample micro-batch: a Tensor (any device, ``meta`` included), a shape
    (``torch.Size`` or a tuple of ints: the default dtype), or a tuple/list of those."""
    if isinstance(args, torch.Tensor) or _is_shape(args):
        args = (args,)
    if not isinstance(args, (tuple, list)) or not args:
        raise TypeError(f"{what} must be a Tensor, a shape, or a non-empty tuple of them, got {type(args).__name__}")
    out = []
    for k, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            out.append(TensorMeta(tuple(a.shape), a.dtype))
        elif _is_shape(a):
            if any(d < 0 for d in a):
                raise ValueError(f"{what}[{k}]: shape {tuple(a)} has a negative dimension")
            out.append(TensorMeta(tuple(int(d) for d in a), torch.get_default_dtype()))
        else:
            raise TypeError(f"{what}[{k}] must be a Tensor or a shape (tuple of ints), got {type(a).__name__}")
    return tuple(out)


def _check_passable(metas: Sequence[TensorMeta], what: str) -> str:
    """'' when these tensors can travel to the next stage, else why not."""
    if len(metas) > _MAX_TENSORS:
        return f"{what} has {len(metas)} tensors; at most {_MAX_TENSORS} may pass between stages"
    for k, m in enumerate(metas):
        if m.dtype not in _DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
            return f"{what}[{k}] has dtype {m.dtype}; tensors passed between stages must be one of {names}"
        if len(m.shape) > _MAX_DIMS:
            return f"{what}[{k}] has {len(m.shape)} dimensions; at most {_MAX_DIMS} may pass between stages"
    return ""


def _encode(table: Optional[Sequence[Sequence[TensorMeta]]], n: int) -> torch.Tensor:
    """``n`` set-up records, one per micro-batch (``table`` None: the upstream failed)."""
    rec = [[0] * _REC_LEN for _ in range(n)]
    if table is None:
        rec[0][0] = _UPSTREAM_FAILED
        return torch.tensor(rec, dtype=torch.int64)
    for row, metas in zip(rec, table):
        row[1] = len(metas)
        for k, m in enumerate(metas):
            base = 2 + k * (2 + _MAX_DIMS)
            row[base] = _DTYPES.index(m.dtype)
            row[base + 1] = len(m.shape)
            row[base + 2 : base + 2 + len(m.shape)] = list(m.shape)
    return torch.tensor(rec, dtype=torch.int64)


def _decode(rec: torch.Tensor) -> Optional[List[Tuple[TensorMeta, ...]]]:
    rows = rec.tolist()
    if rows[0][0] != _OK:
        return None
    table = []
    for v in rows:
        out = []
        for k in range(v[1]):
            base = 2 + k * (2 + _MAX_DIMS)
            out.append(TensorMeta(tuple(v[base + 2 : base + 2 + v[base + 1]]), _DTYPES[v[base]]))
        table.append(tuple(out))
    return table


def _kwargs_key(kwargs: Optional[Dict[str, Any]]) -> Any:
    """What of stage 0's keyword arguments can change its outputs' shapes: their tensors' shapes."""
    if not kwargs:
        return None
    return tuple(
        (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, id(v)) for k, v in sorted(kwargs.items())
    )


def as_tuple(x: Any) -> Tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def resolve_group(group: Any, role: str, what: str) -> Any:
    """The ``fairscale_c.distributed`` group for ``group``: a torch ProcessGroup gets its engine
    group of ``role``; a fairscale_c Group / LocalGroup is used as is; None means the world (the
    default torch group, or the group built from torchrun's environment)."""
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return fdist.group_for(dist.group.WORLD, role)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return fdist.get_group()
        return fdist.LocalGroup()
    if isinstance(group, (fdist.Group, fdist.LocalGroup)):
        return group
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return fdist.group_for(group, role)
    raise TypeError(
        f"{what} must be a torch.distributed ProcessGroup, a fairscale_c.distributed Group, or None, "
        f"got {type(group).__name__}"
    )


class _AutocastSeen(Exception):
    """The meta-device pass met autocast, which does not apply to meta tensors."""


class _WatchAutocast(torch.overrides.TorchFunctionMode):
    """Notes whether autocast is on for `device_type` when any torch function runs in the block
    (around the whole pass, or entered inside the module's forward)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type, self.seen = device_type, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.seen and torch.is_autocast_enabled(self.device_type):
            self.seen = True
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _on_meta(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s parameters and buffers are meta tensors of the same shapes
    (tied ones stay tied); the originals are put back afterwards, whatever happens, and so is
    every submodule's other state: an attribute, buffer or submodule the forward set or added
    (a cache built on the first call, a call counter) is undone, so that the module's first real
    forward finds it as it was."""
    swapped: List[Tuple[Dict[str, Any], str, torch.Tensor]] = []
    metas: Dict[int, torch.Tensor] = {}
    states = [
        (mod, dict(mod.__dict__), set(mod._parameters), set(mod._buffers), set(mod._modules))
        for mod in module.modules()
    ]
    try:
        for mod in module.modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in metas:
                        metas[id(t)] = torch.empty_like(t, device="meta")
                    swapped.append((store, name, t))
                    store[name] = metas[id(t)]
        yield
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t
        for mod, attrs, params, buffers, children in states:
            for store, keep in ((mod._parameters, params), (mod._buffers, buffers), (mod._modules, children)):
                for name in [n for n in store if n not in keep]:
                    del store[name]
            mod.__dict__.clear()
            mod.__dict__.update(attrs)


class PipelineStage:
    """One of this process's stages of a multi-process pipeline.

    Args:
        module: the layers this stage runs; its forward takes the previous stage's outputs (stage
            0: the micro-batch's inputs) as positional arguments and returns a Tensor or a tuple
            of Tensors.
        stage_index: this stage's place in the pipeline (default: this process's rank in
            ``group``); stage i runs on group rank ``i % group size``.
        num_stages: stages in the pipeline: the group's size (default), or a multiple of it for
            ScheduleInterleaved1F1B or ScheduleLoopedBFS (several stages per rank).
        device: where the stage computes (default: the device of the module's first parameter,
            else CPU). For CUDA the group's NCCL communicator is created now.
        input_args: what one micro-batch's input to this stage looks like: a sample Tensor (any
            device, ``meta`` included), a shape (tuple of ints, default dtype), or a tuple of
            those. Optional: when left out it is taken from the previous stage (stage 0: from the
            first micro-batch). When given, the first step checks it against what arrives.
        group: the pipeline group: a torch.distributed ProcessGroup (its engine group of role
            ``"pipeline"`` is used), a ``fairscale_c.distributed`` Group, or None for the world.
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: Optional[int] = None,
        num_stages: Optional[int] = None,
        device: Any = None,
        input_args: Any = None,
        group: Any = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage: module must be a torch.nn.Module, got {type(module).__name__}")
        self.group = resolve_group(group, "pipeline", "PipelineStage: group")
        size, rank = self.group.size, self.group.rank
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"PipelineStage: {name} must be an int, got {type(value).__name__}")
        num_stages = size if num_stages is None else num_stages
        if num_stages < size or num_stages % size:
            raise ValueError(
                f"PipelineStage: num_stages={num_stages} but the pipeline group has {size} ranks; expected the "
                "group size (one stage per rank) or, for ScheduleInterleaved1F1B and ScheduleLoopedBFS, a multiple "
                "of it"
            )
        stage_index = rank if stage_index is None else stage_index
        if not 0 <= stage_index < num_stages or stage_index % size != rank:
            raise ValueError(
                f"PipelineStage: stage_index={stage_index} but this process is rank {rank} of the pipeline "
                f"group; stage i runs on group rank i % {size} (expected one of {list(range(rank, num_stages, size))})"
            )
        self.module = module
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        # gradients travel on this group; the schedules of several stages per rank give them a group of
        # their own on the CPU, and choose a group per message on CUDA (schedule._edge_groups)
        self.grad_group = self.group
        if device is None:
            first = next(module.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"PipelineStage: argument 'device' is not a device: {device!r} ({exc})") from None
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"PipelineStage: device must be a CPU or CUDA device, got {self.device}")
        self.declared_inputs = metas_of(input_args, "PipelineStage: input_args") if input_args is not None else None
        if self.device.type == "cuda" and size > 1:
            self.group.init_nccl(self.device)
        # known after the first step's set-up: the tensors of each micro-batch
        self.input_metas: Optional[List[Tuple[TensorMeta, ...]]] = None
        self.output_metas: Optional[List[Tuple[TensorMeta, ...]]] = None
        self._inputs: Dict[int, Tuple[torch.Tensor, ...]] = {}  # micro-batch -> inputs (kept for backward)
        self._outputs: Dict[int, Tuple[torch.Tensor, ...]] = {}  # micro-batch -> outputs (with their graph)
        self._losses: Dict[int, torch.Tensor] = {}
        self._grads: Dict[int, Tuple[torch.Tensor, ...]] = {}  # micro-batch -> gradients received
        self.output_chunks: List[Tuple[torch.Tensor, ...]] = []  # last stage: detached outputs of a step

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, device={self.device})"

    @property
    def prev(self) -> int:
        """Group rank of the previous stage."""
        return (self.stage_index - 1) % self.group.size

    @property
    def next(self) -> int:
        """Group rank of the next stage."""
        return (self.stage_index + 1) % self.group.size

    # ------------------------------------------------------------------ set-up
    @property
    def ready(self) -> bool:
        return self.input_metas is not None

    @property
    def input_meta(self) -> Optional[Tuple[TensorMeta, ...]]:
        """The first micro-batch's inputs (None before the set-up)."""
        return self.input_metas[0] if self.input_metas is not None else None

    @property
    def output_meta(self) -> Optional[Tuple[TensorMeta, ...]]:
        """The first micro-batch's outputs (None before the set-up)."""
        return self.output_metas[0] if self.output_metas is not None else None

    def setup(
        self,
        microbatches: Optional[Sequence[Tuple[torch.Tensor, ...]]] = None,
        kwargs: Optional[Sequence[Dict[str, Any]]] = None,
        n_microbatches: int = 1,
        output_check: Optional[Callable[[List[Tuple[TensorMeta, ...]]], str]] = None,
    ) -> None:
        """Agree on the tensors passed between stages for each of the ``n_microbatches``
        micro-batches (a collective over the pipeline group; every stage calls it, stage 0 with
        its micro-batches and their keyword arguments). ``output_check`` (last stage) may refuse
        the outputs with a message. Raises the same ValueError on every rank when any stage's
        shapes do not fit."""
        err, table, upstream_ok = "", None, True
        if self.is_first:
            if microbatches is None or len(microbatches) != n_microbatches:
                raise ValueError(f"PipelineStage.setup: stage 0 needs its {n_microbatches} micro-batches")
            table = [metas_of(mb, "step: the micro-batch") for mb in microbatches]
        else:
            rec = torch.empty(n_microbatches, _REC_LEN, dtype=torch.int64)
            self.group.recv(rec, self.prev)
            table = _decode(rec)
            upstream_ok = table is not None
        if upstream_ok and self.declared_inputs is not None and table[0] != self.declared_inputs:
            source = "its micro-batch is" if self.is_first else f"stage {self.stage_index - 1} sends"
            err = (
                f"shape mismatch between stages: stage {self.stage_index} was built with input_args "
                f"{describe(self.declared_inputs)} but {source} {describe(table[0])}"
            )
        out_table: Optional[List[Tuple[TensorMeta, ...]]] = None
        if upstream_ok and not err:
            out_table, err = self._infer_table(table, microbatches, kwargs)
        if not err and out_table is not None and not self.is_last:
            for metas in dict.fromkeys(out_table):
                err = err or _check_passable(metas, f"stage {self.stage_index}'s output")
        if not err and out_table is not None and output_check is not None:
            err = output_check(out_table)
        if not self.is_last:
            self.group.send(_encode(out_table if upstream_ok and not err else None, n_microbatches), self.next)
        verdicts = self._agree(err)
        bad = [m for m in verdicts if m]
        if bad:
            raise ValueError("pipeline set-up failed: " + "; ".join(bad))
        self.input_metas, self.output_metas = table, out_table
        if self.device.type == "cuda" and self.group.size > 1:
            # the schedules' first messages are one-sided (stage 0 sends and receives in one
            # batch, stage 1 receives, then sends): connect each neighbouring pair symmetrically
            self.group.connect(([] if self.is_first else [self.prev]) + ([] if self.is_last else [self.next]))

    def _infer_table(
        self,
        table: List[Tuple[TensorMeta, ...]],
        microbatches: Optional[Sequence[Tuple[torch.Tensor, ...]]],
        kwargs: Optional[Sequence[Dict[str, Any]]],
    ) -> Tuple[Optional[List[Tuple[TensorMeta, ...]]], str]:
        """Output metadata per micro-batch, inferred once per distinct input (an uneven split
        has two: the larger micro-batches first, then the smaller ones)."""
        done: Dict[Any, Tuple[TensorMeta, ...]] = {}
        out = []
        for i, metas in enumerate(table):
            kw = kwargs[i] if kwargs is not None and self.is_first else None
            key = (metas, _kwargs_key(kw))
            if key not in done:
                sample = microbatches[i] if microbatches is not None and self.is_first else None
                got, err = self._infer_outputs(metas, sample, kw)
                if err or got is None:
                    return None, err
                done[key] = got
            out.append(done[key])
        return out, ""

    def _infer_outputs(
        self,
        metas: Tuple[TensorMeta, ...],
        sample: Optional[Tuple[torch.Tensor, ...]],
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Tuple[Optional[Tuple[TensorMeta, ...]], str]:
        """Output metadata of the module on inputs described by ``metas``: on the meta device
        (parameters and buffers replaced by meta tensors, so nothing is computed or changed), else
        by running it once without gradients (RNG state and buffers restored afterwards). Stage 0
        given keyword arguments runs for real on its first micro-batch and their first chunk, and
        so does a stage whose pass meets autocast (around the step or inside the module), which
        decides dtypes on the real device only. The module's warnings in this extra pass (a
        reentrant checkpoint's "none of the inputs have requires_grad", say) are not the user's:
        the steps give theirs."""
        try:
            if kwargs:
                raise NotImplementedError("keyword arguments are not moved to the meta device")
            args = tuple(torch.empty(m.shape, dtype=m.dtype, device="meta") for m in metas)
            watch = _WatchAutocast(self.device.type)
            with torch.random.fork_rng(devices=self._rng_devices()), torch.no_grad(), _on_meta(self.module):
                with warnings.catch_warnings(), watch:
                    warnings.simplefilter("ignore")
                    out = self.module(*args)
            if watch.seen:
                raise _AutocastSeen()
        except Exception:  # noqa: BLE001 - a module the meta device cannot run: run it for real
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = self._sample_forward(metas, sample, kwargs)
            except Exception as e:  # noqa: BLE001 - reported to every rank by setup()
                return None, (
                    f"stage {self.stage_index}'s module raised {type(e).__name__} on inputs {describe(metas)}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}"
                )
        outs = as_tuple(out)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            kinds = ", ".join(type(o).__name__ for o in outs)
            return None, f"stage {self.stage_index}'s module must return a Tensor or a tuple of Tensors, got ({kinds})"
        return tuple(TensorMeta(tuple(o.shape), o.dtype) for o in outs), ""

    def _sample_forward(
        self,
        metas: Tuple[TensorMeta, ...],
        sample: Optional[Tuple[torch.Tensor, ...]],
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        if sample is None:
            sample = tuple(torch.zeros(m.shape, dtype=m.dtype, device=self.device) for m in metas)
        saved = [b.detach().clone() for b in self.module.buffers()]
        try:
            with torch.random.fork_rng(devices=self._rng_devices()), torch.no_grad():
                # copies: the module may change its inputs in place, and these are the caller's
                sample = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in sample)
                kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in (kwargs or {}).items()}
                return self.module(*sample, **kwargs)
        finally:
            with torch.no_grad():
                for b, s in zip(self.module.buffers(), saved):
                    b.copy_(s)

    def _rng_devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    def _agree(self, err: str) -> List[str]:
        """Every stage's set-up verdict, on every rank."""
        data = err.encode("utf-8")[:_MSG_BYTES]
        mine = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = torch.zeros(_MSG_BYTES * self.group.size, dtype=torch.uint8)
        self.group.all_gather(every, mine)
        rows = every.view(self.group.size, _MSG_BYTES)
        return [bytes(r.tolist()).rstrip(b"\0").decode("utf-8", "replace") for r in rows]

    # ------------------------------------------------------------------ per micro-batch
    def clear(self) -> None:
        self._inputs.clear()
        self._outputs.clear()
        self._losses.clear()
        self._grads.clear()
        self.output_chunks = []

    def recv_activation_ops(self, mb: int) -> List[fdist.P2POp]:
        """Receives of micro-batch ``mb``'s inputs from the previous stage (fresh buffers sized
        from the set-up's table, kept for the backward)."""
        assert self.input_metas is not None
        bufs = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in self.input_metas[mb])
        self._inputs[mb] = bufs
        return [fdist.P2POp("recv", b, self.prev) for b in bufs]

    def send_activation_ops(self, mb: int) -> List[fdist.P2POp]:
        outs = self._outputs[mb]
        return [fdist.P2POp("send", o.detach().contiguous(), self.next) for o in outs]

    def recv_gradient_ops(self, mb: int) -> List[fdist.P2POp]:
        """Receives of the gradients of micro-batch ``mb``'s floating outputs from the next stage."""
        assert self.output_metas is not None
        metas = self.output_metas[mb]
        bufs = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas if m.floating)
        self._grads[mb] = bufs
        return [fdist.P2POp("recv", b, self.next) for b in bufs]

    def send_gradient_ops(self, mb: int) -> List[fdist.P2POp]:
        ins = self._inputs.pop(mb)
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in ins if x.dtype.is_floating_point]
        return [fdist.P2POp("send", g.contiguous(), self.prev) for g in grads]

    def forward_one(
        self,
        mb: int,
        args: Optional[Tuple[torch.Tensor, ...]],
        has_backward: bool,
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        """Run micro-batch ``mb`` through the module (stage 0: on ``args`` and ``kwargs``; else on
        what was received). Returns the output; the last stage keeps a detached copy for the step's
        result."""
        if self.is_first:
            assert args is not None
            inputs = args
            self._inputs[mb] = inputs
            if has_backward:
                # Micro-batches cut from one batch are views sharing its version counter: an
                # in-place op on one would invalidate what another saved for backward. Copies not.
                inputs = tuple(_copy_view(x) for x in inputs)
                kwargs = {k: _copy_view(v) for k, v in (kwargs or {}).items()}
        else:
            inputs = self._inputs[mb]
            if has_backward:
                for x in inputs:
                    if x.dtype.is_floating_point:
                        x.requires_grad_(True)
                inputs = _inputs_of(inputs)  # non-leaves: the module may change them in place
        out = self.module(*inputs, **(kwargs or {}))
        outs = as_tuple(out)
        if not has_backward:
            outs = tuple(o.detach() for o in outs)
            self._inputs.pop(mb, None)
        if self.is_last:
            self.output_chunks.append(tuple(o.detach() for o in outs))
        self._outputs[mb] = outs
        return out

    def set_loss(self, mb: int, loss: torch.Tensor) -> None:
        self._losses[mb] = loss

    def backward_one(self, mb: int, loss_divisor: float) -> None:
        """Backward of micro-batch ``mb``: from its loss divided by ``loss_divisor`` (last stage)
        or from the gradients received for its outputs."""
        outs = self._outputs.pop(mb)
        if self.is_first:
            self._inputs.pop(mb, None)
        if self.is_last:
            loss = self._losses.pop(mb)
            (loss / loss_divisor if loss_divisor != 1 else loss).backward()
            return
        grads = iter(self._grads.pop(mb))
        pairs = [(o, next(grads)) for o in outs if o.dtype.is_floating_point]
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def drop_forward_state(self, mb: int) -> None:
        """Forward-only steps: forget micro-batch ``mb`` once its output has been sent."""
        self._outputs.pop(mb, None)
        self._inputs.pop(mb, None)


__all__ = ["PipelineStage", "TensorMeta"]
