"""How FSDP reaches the collective engine: one object per process group."""

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from fairscale_c import _C
from fairscale_c.distributed._group import _DoneWork


_CUDA_CASTS = ({torch.float32, torch.float16}, {torch.float32, torch.bfloat16})  # what cuda_cast converts


def _local_copy(output: torch.Tensor, input: torch.Tensor) -> None:
    """Copy or cast without bumping `output`'s version counter (autograd checks it on saved views
    of the full parameters). Host memory goes through the C core, float32 <-> float16/bfloat16
    casts on one GPU through the C kernels (on the current stream), anything else through an alias
    that shares the storage but has a version counter of its own."""
    if output.device.type == "cpu" and input.device.type == "cpu":
        _C.copy_(output, input)
        return
    if (
        output.device == input.device
        and output.device.type == "cuda"
        and {output.dtype, input.dtype} in _CUDA_CASTS
        and output.is_contiguous()
        and input.is_contiguous()
        and output.numel() == input.numel()
    ):
        stream = torch.cuda.current_stream(output.device).cuda_stream
        _C.cuda_cast(output.detach(), input.detach(), stream)
        return
    alias = torch.empty(0, dtype=output.dtype, device=output.device)
    alias.set_(output.untyped_storage(), output.storage_offset(), output.shape, output.stride())
    with torch.no_grad():
        alias.copy_(input)


class _StreamWork:
    """Collectives enqueued on FSDP's CUDA side stream: wait() makes the current stream wait for
    them (the host never blocks)."""

    __slots__ = ("event", "device")

    def __init__(self, stream: "torch.cuda.Stream"):
        self.device = stream.device
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def is_completed(self) -> bool:
        """Whether the side stream has passed the collectives (a host query; never blocks)."""
        return self.event.query()


def _on_side_stream(fsdp: Any, device: torch.device, comm: "Comm"):
    """Context for enqueueing `comm`'s collectives on the root's side stream for that communicator
    and CUDA `device`, ordered after everything already on the current stream; (context, stream),
    stream None on the CPU. One stream per communicator keeps each communicator's operations in
    issue order on every rank; with a separate reduce-scatter group, gradient reductions and
    all-gathers run beside each other and beside compute (as with FairScale's streams)."""
    if device.type != "cuda":
        return contextlib.nullcontext(), None
    root = getattr(fsdp, "_root", None) or fsdp
    streams = root.__dict__.setdefault("_side_streams", {})
    key = (device, id(comm.group))
    side = streams.get(key)
    if side is None:
        side = streams[key] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(side), side


class Comm:
    """Collectives FSDP needs, over fairscale_c's engine for the given torch process group."""

    def __init__(self, process_group: Any = None, role: str = "default"):
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        if process_group is None:
            self.rank, self.world_size, self.group = 0, 1, None
            return
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.group = _engine_group(process_group, role) if self.world_size > 1 else None

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        if self.group is None:
            _local_copy(output, input)
            return _DoneWork() if async_op else None
        return self.group.all_gather(output, input, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str, async_op: bool = False):
        if self.group is None:
            _local_copy(output, input)
            return _DoneWork() if async_op else None
        return self.group.reduce_scatter(output, input, op=op, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        if self.group is not None:
            self.group.all_reduce(tensor, op=op)


_GROUPS = {}


def _engine_group(process_group, role: str = "default"):
    """One engine group per (torch process group, role), built once (a collective over that
    group). Role "reduce_scatter" gives FSDP's gradient reductions a communicator of their own (a
    second progress thread on CPU, a second NCCL communicator on CUDA), as FairScale's separate
    reduce-scatter process group does, so they can run beside all-gathers."""
    from fairscale_c import distributed as fdist

    key = (id(process_group), role)
    if key not in _GROUPS:
        _release_destroyed_groups()
        _GROUPS[key] = (process_group, fdist.init_group(process_group))
    return _GROUPS[key][1]


def _release_destroyed_groups() -> None:
    """Destroy the engine groups of torch process groups that torch has destroyed, so a process
    that initialises and destroys torch.distributed repeatedly (sweeps, test suites) does not
    keep a progress thread and a shared-memory mapping per past process group. Runs where every
    rank builds its next group, so every rank releases the same ones."""
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if live is None:  # a torch without this registry: keep everything
        return
    for key, (pg, group) in list(_GROUPS.items()):
        if pg not in live:
            del _GROUPS[key]
            group.destroy()
