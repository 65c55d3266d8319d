"""Group: one rank's view of a set of processes, dispatching each op by tensor device —
CPU tensors to the shared-memory engine in C (or, for groups spanning hosts, to the
torch.distributed group they were built from), CUDA tensors to the NCCL backend."""

from __future__ import annotations

import atexit
import json
import os
import socket
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _C
from ._rendezvous import Exchange, ProcessGroupExchange, StoreExchange, timeout_s

_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged

# Seconds an op may still wait for a peer when its group is closed at interpreter exit or while an
# exception unwinds a ``with`` block; after that it is abandoned (it fails), so a rank that was
# interrupted (Ctrl-C) or failed while a peer is alive but absent exits at once instead of holding
# on until FAIRSCALE_C_TIMEOUT.
_UNWIND_GRACE_S = 2.0

_LIVE: "weakref.WeakSet[Group]" = weakref.WeakSet()


@atexit.register
def _close_live_groups() -> None:
    for group in list(_LIVE):
        try:
            group._close(_UNWIND_GRACE_S)
        except Exception:  # noqa: BLE001 - at exit (or in a fork() child of the owner) nothing is left to tell
            pass


def hostname() -> str:
    """Host identity compared at rendezvous; FAIRSCALE_C_HOSTNAME overrides it (containers that
    share a hostname but not /dev/shm)."""
    return os.environ.get("FAIRSCALE_C_HOSTNAME") or socket.gethostname()


def _device_type(t: Any, argname: str, op: str) -> int:
    try:
        return int(t.__dlpack_device__()[0])
    except AttributeError:
        raise TypeError(
            f"{op}: {argname} must be a tensor supporting DLPack (torch.Tensor, numpy array), got {type(t).__name__}"
        ) from None


class _DoneWork:
    """Work of an op that finished when it was issued (stream-ordered CUDA ops, torch fallback)."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _TorchCPU:
    """CPU ops on the torch.distributed group a cross-host group was built from."""

    _OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.SUM}

    def __init__(self, pg: "dist.ProcessGroup", size: int) -> None:
        self.pg, self.size = pg, size

    def _g(self, r: int) -> int:
        return dist.get_global_rank(self.pg, r)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        dist.all_gather(list(output.view(-1).chunk(self.size)), input.view(-1), group=self.pg)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
        full = input.view(-1).clone()
        self.all_reduce(full, op)
        output.view(-1).copy_(full.chunk(self.size)[dist.get_rank(self.pg)])

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        dist.all_reduce(tensor, op=self._OPS[op], group=self.pg)
        if op == "avg":
            tensor.div_(self.size)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        dist.broadcast(tensor, src=self._g(root), group=self.pg)

    def reduce(self, tensor: torch.Tensor, root: int, op: str) -> None:
        dist.reduce(tensor, dst=self._g(root), op=self._OPS[op], group=self.pg)
        if op == "avg" and dist.get_rank(self.pg) == root:
            tensor.div_(self.size)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor, dst=self._g(dst), group=self.pg)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        dist.recv(tensor, src=self._g(src), group=self.pg)

    def barrier(self) -> None:
        dist.barrier(group=self.pg)


class Group:
    """A group of ranks. Build one with :func:`fairscale_c.distributed.init_group` or
    :meth:`new_group`; ranks passed to ops (root, src, dst) are ranks *of this group*.

    Every rank must issue the same collectives in the same order. ``async_op=True`` returns a
    Work (``wait(timeout=None)``, ``is_completed()``); works complete in issue order.
    """

    def __init__(self, exchange: Exchange, name: str, pg: Optional["dist.ProcessGroup"] = None) -> None:
        self.rank, self.size, self.name = exchange.rank, exchange.size, name
        self._exchange, self._pg = exchange, pg
        self._shm: Optional[Any] = None
        self._torch_cpu: Optional[_TorchCPU] = None
        self._nccl: Optional[Any] = None
        self._subgroups = 0
        self._rendezvous()
        _LIVE.add(self)

    # ------------------------------------------------------------------ setup / teardown
    def _rendezvous(self) -> None:
        timeout_s()  # an invalid FAIRSCALE_C_TIMEOUT is a ValueError before anything is exchanged
        # Rank 0 publishes the segment's name before creating it: if it dies at any point, the
        # peers know the name and remove whatever it left (see fsc_shm_group_open). The name
        # carries rank 0's pid and pid namespace, so a later group can sweep it if every rank
        # is killed before it was removed.
        segment = _C._shm_segment_name() if self.rank == 0 else None
        shm = None
        try:
            me = {"host": hostname(), "pid": os.getpid(), "segment": segment}
            infos = [json.loads(b) for b in self._exchange.all_gather(json.dumps(me).encode())]
            hosts = sorted({i["host"] for i in infos})
            if len(hosts) > 1:
                if self._pg is None:
                    raise _C.DistributedError(
                        f"group '{self.name}' spans hosts {hosts}: the shared-memory backend needs every rank on "
                        "one host. Build the group from an initialised torch.distributed process group "
                        "(init_group(pg)) to run CPU collectives through it, or use CUDA tensors (NCCL)."
                    )
                self._torch_cpu = _TorchCPU(self._pg, self.size)
                return
            error = None
            try:
                if self.rank == 0:
                    shm = _C.ShmGroup(self.name, 0, self.size, segment, create=True)
                else:
                    shm = _C.ShmGroup(self.name, self.rank, self.size, infos[0]["segment"], creator_pid=infos[0]["pid"])
            except Exception as exc:  # reported to the peers below, then raised
                error = exc
            # Every rank says whether it attached. The pids are known now, so a rank that died
            # since the first exchange is named within a fraction of a second instead of at the
            # timeout, and one that could not attach is named with its reason.
            pids = {r: int(i["pid"]) for r, i in enumerate(infos)}
            report = {"error": None if error is None else f"{type(error).__name__}: {error}"}
            reports = [json.loads(b) for b in self._exchange.all_gather(json.dumps(report).encode(), pids)]
            if error is not None:
                raise error
            failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"] is not None]
            if failed:
                raise _C.DistributedError(
                    f"rendezvous of group '{self.name}' (rank {self.rank} of {self.size}): "
                    + "; ".join(f"rank {r} could not open the shared memory ({why})" for r, why in failed)
                )
            shm.join()
            self._shm = shm
        except BaseException:
            if shm is not None:
                shm.close()  # removes the segment's name too
            raise

    def destroy(self) -> None:
        """Finish queued ops and release the shared memory and NCCL communicator. Idempotent."""
        self._close(None)

    def _close(self, grace: Optional[float]) -> None:
        """destroy(); with `grace`, an op still waiting for a peer after that many seconds is
        abandoned, and teardown errors are swallowed (the exit and error-unwinding path)."""
        _LIVE.discard(self)
        shm, self._shm = self._shm, None
        nccl, self._nccl = self._nccl, None
        self._torch_cpu = None
        if shm is not None:
            shm.close(grace)
        if nccl is not None:
            if grace is None:
                nccl.destroy()
            else:
                try:
                    nccl.destroy(timeout=grace)  # on timeout the communicator is aborted
                except Exception:  # noqa: BLE001 - exiting or unwinding: the first error is what matters
                    nccl.abort()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._close(None if exc_type is None else _UNWIND_GRACE_S)

    def __repr__(self) -> str:
        backend = "shm" if self._shm is not None else ("torch" if self._torch_cpu is not None else "destroyed")
        return f"Group(name={self.name!r}, rank={self.rank}, size={self.size}, cpu_backend={backend})"

    def new_group(self, ranks: Sequence[int]) -> Optional["Group"]:
        """A subgroup of the given ranks of this group. Every rank of this group must call it with
        the same ``ranks``, in the same order as its other new_group calls; non-members get None."""
        ranks = [int(r) for r in ranks]
        if sorted(set(ranks)) != sorted(ranks) or not ranks or any(r < 0 or r >= self.size for r in ranks):
            raise ValueError(
                f"new_group: ranks must be distinct ranks of group '{self.name}' (0..{self.size - 1}), got {ranks}"
            )
        self._subgroups += 1
        name = f"{self.name}/sub{self._subgroups}"
        if isinstance(self._exchange, ProcessGroupExchange):
            global_ranks = [dist.get_global_rank(self._pg, r) for r in ranks]  # type: ignore[arg-type]
            pg = dist.new_group(global_ranks)  # collective over the default group
            return Group(ProcessGroupExchange(pg, name), name, pg) if self.rank in ranks else None
        if self.rank not in ranks:
            return None
        # a store-built subgroup has no torch group to fall back to across hosts
        return Group(self._exchange.sub(ranks), name, None)

    # ------------------------------------------------------------------ dispatch
    def _cpu(self) -> Any:
        backend = self._shm if self._shm is not None else self._torch_cpu
        if backend is None:
            raise RuntimeError(f"group '{self.name}' has been destroyed")
        return backend

    def _cuda(self) -> Any:
        if self._nccl is None:
            try:
                from ._nccl import NcclBackend
            except Exception as exc:
                raise RuntimeError(
                    f"group '{self.name}': CUDA tensors need the NCCL backend, which is unavailable "
                    f"({exc.__class__.__name__}: {exc})"
                ) from exc
            self._nccl = NcclBackend(self.rank, self.size, self._exchange.broadcast)
        return self._nccl

    def _route(self, op: str, *named: Any) -> bool:
        """True for CUDA; checks that every (argname, tensor) pair lives on the same device type."""
        kinds = [(name, _device_type(t, name, op)) for name, t in named]
        first_name, first = kinds[0]
        for name, kind in kinds[1:]:
            if (kind in _DLPACK_CUDA) != (first in _DLPACK_CUDA):
                raise ValueError(
                    f"{op}: {name} is on {'cuda' if kind in _DLPACK_CUDA else 'cpu'} but {first_name} is "
                    f"on {'cuda' if first in _DLPACK_CUDA else 'cpu'}; expected the same device"
                )
        return first in _DLPACK_CUDA

    def _run(self, op: str, cuda: bool, async_op: bool, args: tuple, kwargs: dict) -> Any:
        if cuda:
            getattr(self._cuda(), op)(*args, **kwargs)
            return _DoneWork() if async_op else None
        backend = self._cpu()
        if backend is self._shm:
            return getattr(backend, op)(*args, async_op=async_op, **kwargs)
        getattr(backend, op)(*args, **kwargs)
        return _DoneWork() if async_op else None

    # ------------------------------------------------------------------ collectives
    def all_gather(self, output: Any, input: Any, async_op: bool = False) -> Any:
        """output (size * input.numel() elements) = every rank's input, in rank order."""
        cuda = self._route("all_gather", ("output", output), ("input", input))
        return self._run("all_gather", cuda, async_op, (output, input), {})

    def reduce_scatter(self, output: Any, input: Any, op: str = "sum", async_op: bool = False) -> Any:
        """output = block ``rank`` (output.numel() elements) of the reduction of every rank's input."""
        cuda = self._route("reduce_scatter", ("output", output), ("input", input))
        return self._run("reduce_scatter", cuda, async_op, (output, input), {"op": op})

    def all_reduce(self, tensor: Any, op: str = "sum", async_op: bool = False) -> Any:
        """In place: tensor = reduction (sum | avg | max | min) over ranks."""
        cuda = self._route("all_reduce", ("tensor", tensor))
        return self._run("all_reduce", cuda, async_op, (tensor,), {"op": op})

    def broadcast(self, tensor: Any, root: int = 0, async_op: bool = False) -> Any:
        """In place: every rank's tensor = root's."""
        cuda = self._route("broadcast", ("tensor", tensor))
        return self._run("broadcast", cuda, async_op, (tensor,), {"root": root})

    def reduce(self, tensor: Any, root: int = 0, op: str = "sum", async_op: bool = False) -> Any:
        """root's tensor = reduction over ranks; other ranks' tensors are left unchanged."""
        cuda = self._route("reduce", ("tensor", tensor))
        return self._run("reduce", cuda, async_op, (tensor,), {"root": root, "op": op})

    def send(self, tensor: Any, dst: int, async_op: bool = False) -> Any:
        """Send to group rank ``dst``; the sync form returns once dst has received it."""
        if self._route("send", ("tensor", tensor)):
            self._cuda().send(tensor, dst)
            return _DoneWork() if async_op else None
        return self._run("send", False, async_op, (tensor,), {"dst": dst})

    def recv(self, tensor: Any, src: int, async_op: bool = False) -> Any:
        """Receive from group rank ``src`` into tensor (same numel and dtype as sent)."""
        if self._route("recv", ("tensor", tensor)):
            self._cuda().recv(tensor, src)
            return _DoneWork() if async_op else None
        return self._run("recv", False, async_op, (tensor,), {"src": src})

    def barrier(self, async_op: bool = False) -> Any:
        """Every rank waits for all the others (CPU engine; also the NCCL one if it is in use)."""
        work = self._run("barrier", False, async_op, (), {})
        if self._nccl is not None:
            self._nccl.barrier()
        return work


__all__ = ["Group", "StoreExchange", "hostname"]
