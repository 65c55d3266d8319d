"""Group: one rank's view of a set of processes, dispatching each op by tensor device —
CPU tensors to the shared-memory engine in C (or, for groups spanning hosts, to the
torch.distributed group they were built from), CUDA tensors to the NCCL backend."""

from __future__ import annotations

import atexit
import json
import os
import socket
import weakref
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _C
from ..internal.args import as_int
from . import _alltoall, _rules
from ._p2p import P2POp, batch_items, check_tag, item_tag
from ._rendezvous import Exchange, ProcessGroupExchange, StoreExchange, timeout_s
from ._work import CompletedWork, CudaWork, local_copy

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


def gpu_identity() -> Optional[str]:
    """The UUID of this process's current CUDA device, compared at rendezvous to tell ranks that
    share a GPU; None where this process has not initialised CUDA (the rendezvous must not do it:
    a process that forks later could no longer use CUDA in its children)."""
    if not torch.cuda.is_initialized():
        return None
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    return str(uuid) if uuid else None


def _pids_on_this_host(parts: Sequence[bytes]) -> Dict[int, int]:
    """rank -> pid for the ranks of a rendezvous's first exchange that run on this host."""
    me = hostname()
    infos = [json.loads(b) for b in parts]
    return {r: int(i["pid"]) for r, i in enumerate(infos) if i.get("host") == me}


def _gpus_shared(infos: Sequence[dict]) -> bool:
    """Whether two ranks' rendezvous infos name the same GPU on the same host."""
    seen = [(i["host"], i["gpu"]) for i in infos if i.get("gpu")]
    return len(seen) != len(set(seen))


def _device_type(t: Any, argname: str, op: str) -> int:
    try:
        return int(t.__dlpack_device__()[0])
    except AttributeError:
        raise TypeError(
            f"{op}: {argname} must be a tensor supporting DLPack (torch.Tensor, numpy array), got {type(t).__name__}"
        ) from None


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

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        dist.send(tensor, dst=self._g(dst), group=self.pg, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        dist.recv(tensor, src=self._g(src), group=self.pg, tag=tag)

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, out_splits: Any, in_splits: Any) -> None:
        _alltoall.check_single(output, input, out_splits, in_splits, dist.get_rank(self.pg), self.size)
        dist.all_to_all_single(output, input, out_splits, in_splits, group=self.pg)

    def copy(self, output: torch.Tensor, input: torch.Tensor) -> None:
        local_copy(output, input)

    def batch(self, items: list) -> None:
        """Sends and recvs through torch's batch_isend_irecv, then the collectives in order."""
        p2p = [
            dist.P2POp(
                dist.isend if i[0] == "send" else dist.irecv, i[1], self._g(i[2]), group=self.pg, tag=item_tag(i)
            )
            for i in items
            if i[0] in ("send", "recv")
        ]
        for work in dist.batch_isend_irecv(p2p) if p2p else []:
            work.wait()
        for name, *args in items:
            if name == "reduce":
                self.reduce(args[0], root=args[2], op=args[1])
            elif name not in ("send", "recv"):
                getattr(self, name)(*args)


class Group:
    """A group of ranks. Build one with :func:`fairscale_c.distributed.init_group` or
    :meth:`new_group`; ranks passed to ops (root, src, dst) are ranks *of this group*.

    Every rank must issue the same collectives in the same order. ``async_op=True`` returns a
    Work (``wait(timeout=None)``, ``is_completed()``); works complete in issue order.
    """

    def __init__(self, exchange: Exchange, name: str, pg: Optional["dist.ProcessGroup"] = None) -> None:
        self.rank, self.size, self.name = exchange.rank, exchange.size, name
        self._exchange, self._pg = exchange, pg
        self._pg_built = pg is not None  # built on a torch process group (kept after close)
        self.process_group = pg  # the torch.distributed group it was built from, if any
        self._side: dict = {}  # CUDA device -> the stream this group's asynchronous NCCL ops run on
        self._last: dict = {}  # CUDA device -> the stream this group's last NCCL op was enqueued on
        self._shm: Optional[Any] = None
        self._torch_cpu: Optional[_TorchCPU] = None
        self._closed = False
        self._was_shared = False  # closed while it was a torch process group's shared engine group
        self._nccl: Optional[Any] = None
        self._subgroups = 0
        self.shares_gpu = False  # two ranks on one GPU (set at rendezvous; see gpu_identity)
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
            me = {"host": hostname(), "pid": os.getpid(), "segment": segment, "gpu": gpu_identity()}
            # A rank that dies once its part is in is named while rank 0 waits for every rank to
            # have read the parts (only ranks on this host: a pid means nothing elsewhere).
            infos = [
                json.loads(b) for b in self._exchange.all_gather(json.dumps(me).encode(), pids_in=_pids_on_this_host)
            ]
            self.shares_gpu = _gpus_shared(infos)
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
                    shm = _C.ShmGroup(
                        self.name,
                        self.rank,
                        self.size,
                        infos[0]["segment"],
                        creator_pid=infos[0]["pid"],
                        poll=self._creator_failed,
                    )
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

    def _creator_failed(self) -> None:
        """Called while this rank waits for rank 0's segment: rank 0 reports before its peers
        do (the all_gather below), so a report that it failed ends the wait at once."""
        part = self._exchange.peek(0)
        error = None if part is None else json.loads(part)["error"]
        if error is not None:
            raise _C.DistributedError(
                f"rendezvous of group '{self.name}' (rank {self.rank} of {self.size}): rank 0 could not create "
                f"the shared memory ({error})"
            )

    def destroy(self) -> None:
        """Finish queued ops and release the shared memory and NCCL communicator. Idempotent."""
        self._close(None)

    def abort(self) -> None:
        """Give up on this group after an error left this rank's part of its ops unfinished (a
        pipeline step that raised half way, say), so that no rank waits out FAIRSCALE_C_TIMEOUT
        for it. CPU (shared-memory engine): from now on every rank's ops on the group, this rank's
        included, raise DistributedError naming this rank; ops already waiting end within about
        50 ms. CUDA: this rank's NCCL communicator is aborted, and its later ops raise; the peers'
        NCCL ops end at their timeout. A group across hosts without the shared-memory engine tells
        nobody. Destroy the group afterwards. Idempotent."""
        if self._shm is not None:
            self._shm.give_up()
        if self._nccl is not None:
            self._nccl.abort()

    def _close(self, grace: Optional[float]) -> None:
        """destroy(); with `grace`, an op still waiting for a peer after that many seconds is
        abandoned, and teardown errors are swallowed (the exit and error-unwinding path)."""
        if self._shm is not None:
            self._shm.check_closable()  # before anything changes
        _LIVE.discard(self)
        self._closed = True
        for key, (_, group) in list(REGISTRY.items()):
            if group is self:
                del REGISTRY[key]
                self._was_shared = True
        # A closed group holds no reference to its torch process group: once torch has destroyed
        # that group too, it ends (joining its gloo threads) as soon as its user lets go of it,
        # not during interpreter finalization, where a gloo thread still releasing a finished
        # work can no longer take the GIL and aborts the process.
        self._pg = self.process_group = None
        if isinstance(self._exchange, ProcessGroupExchange):
            self._exchange.pg = None
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

    def new_group(self, ranks: Optional[Sequence[int]] = None) -> Optional["Group"]:
        """A subgroup of the given ranks of this group (None: all of them, as in torch). Every rank
        of this group must call it with the same ``ranks``, in the same order as its other
        new_group calls; non-members get None."""
        given = ranks
        ranks = list(range(self.size)) if ranks is None else [as_int(r) for r in ranks]
        if (
            None in ranks or not ranks or len(set(ranks)) != len(ranks) or any(r < 0 or r >= self.size for r in ranks)  # type: ignore[operator]
        ):
            raise ValueError(
                f"new_group: ranks must be distinct int ranks of group '{self.name}' (0..{self.size - 1}), "
                f"got {given!r}"
            )
        self._check_open("new_group")
        self._subgroups += 1
        name = f"{self.name}/sub{self._subgroups}"
        member = self.rank in ranks
        torch_sub = isinstance(self._exchange, ProcessGroupExchange)
        if self._torch_cpu is not None and not torch_sub:
            # spans hosts: the subgroup's CPU ops need a torch group too. torch's new_group is a
            # collective of the whole default group, which every rank calling this one is only
            # when this group is the default group.
            if self.size != dist.get_world_size():
                raise _C.DistributedError(
                    f"new_group: group '{self.name}' spans hosts and is not the default group, so a subgroup "
                    "of it has no torch process group to run CPU collectives through; build it from one: "
                    "init_group(torch.distributed.new_group(ranks)), called on every rank"
                )
            torch_sub = True
        if torch_sub:
            global_ranks = [dist.get_global_rank(self._pg, r) for r in ranks]  # type: ignore[arg-type]
            pg = dist.new_group(global_ranks)  # collective over the default group
            return Group(ProcessGroupExchange(pg, name), name, pg) if member else None
        if not member:
            return None
        return Group(self._exchange.sub(ranks, self._subgroups), name, None)

    # ------------------------------------------------------------------ dispatch
    def _cpu(self) -> Any:
        backend = self._shm if self._shm is not None else self._torch_cpu
        if backend is None:
            raise RuntimeError(self._destroyed_message())
        return backend

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"{op}: {self._destroyed_message()}")

    def _destroyed_message(self) -> str:
        message = f"group '{self.name}' has been destroyed"
        if self._was_shared:
            message += (
                " (it was the engine group that init_group() without a name, group_for() and the features "
                "(FSDP, OSS, ShardedDataParallel, ...) share for a torch process group: destroying it, or leaving "
                "a `with` block on it, ends it for all of them; build a group of your own with init_group(name=...))"
            )
        return message

    def _cuda(self, device: Any = None) -> Any:
        if self._nccl is None:
            self._check_open("CUDA collective")
            try:
                from ._nccl import NcclBackend
            except Exception as exc:
                raise RuntimeError(
                    f"group '{self.name}': CUDA tensors need the NCCL backend, which is unavailable "
                    f"({exc.__class__.__name__}: {exc})"
                ) from exc
            self._nccl = NcclBackend(self.rank, self.size, self._exchange.broadcast, device=device)
        return self._nccl

    def init_nccl(self, device: Any = None) -> None:
        """Create this group's NCCL communicator now (a collective over the group: every rank calls
        it), on ``device`` (default: torch's current CUDA device), so that the first CUDA op is not
        a hidden group-wide set-up. Idempotent."""
        self._cuda(device)

    def connect(self, peers: Sequence[int], device: Any = None) -> None:
        """Set up CUDA point-to-point with ``peers`` (group ranks) now: one single-element send
        and receive with each, in one NCCL group. Each listed peer must call it too, with this
        rank among its peers. Use it before a pair's first CUDA messages when they are one-sided
        (one rank sends and receives, the other only receives): NCCL 2.32 with two ranks sharing
        a GPU aborted the communicator while connecting such a pair (docs/gpu.md). Host tensors
        need nothing of the kind."""
        dev = self._cuda(device).device
        ops = []
        for peer in peers:
            ops += [P2POp("send", torch.zeros(1, device=dev), peer), P2POp("recv", torch.empty(1, device=dev), peer)]
        if ops:
            self.batch(ops)

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        return side

    @staticmethod
    def _route(op: str, *named: Any) -> bool:
        """True for CUDA; checks that every (argname, tensor) pair lives on the same device type."""
        first_name, first = "", None
        for name, t in named:
            cuda = getattr(t, "is_cuda", None)  # torch: a C attribute; others: __dlpack_device__
            if cuda is None:
                cuda = _device_type(t, name, op) in _DLPACK_CUDA
            if first is None:
                first_name, first = name, cuda
            elif cuda != first:
                raise ValueError(
                    f"{op}: {name} is on {'cuda' if cuda else 'cpu'} but {first_name} is "
                    f"on {'cuda' if first else 'cpu'}; expected the same device"
                )
        return bool(first)

    def _cpu_op(self, op: str, async_op: bool, args: tuple, kwargs: dict) -> Any:
        backend = self._cpu()
        if backend is self._shm:
            return getattr(backend, op)(*args, async_op=async_op, **kwargs)
        _rules.check(op, args, kwargs, self.rank, self.size)  # torch's collectives: the engine's rules first
        getattr(backend, op)(*args, **kwargs)
        return CompletedWork() if async_op else None

    def _cuda_op(self, what: str, enqueue: Any, tensors: tuple, async_op: bool) -> Any:
        """Run ``enqueue(nccl, stream)`` after the work already on the current stream. A
        synchronous op goes on the current stream itself (nothing to record or wait for); an
        asynchronous one on this group's side stream, its Work's event marking its end (see
        CudaWork). Either way the op also follows the group's previous op on the device, so that
        its NCCL kernels run in issue order whatever streams the caller used."""
        nccl = self._cuda()
        device = nccl.device
        current = torch.cuda.current_stream(device)
        last = self._last.get(device)
        if not async_op:
            if last is not None and last != current:
                current.wait_stream(last)
            enqueue(nccl, current)
            self._last[device] = current
            return None
        side = self._side_stream(device)
        side.wait_stream(current)
        if last is not None and last != current and last != side:
            side.wait_stream(last)
        enqueue(nccl, side)
        self._last[device] = side
        event = torch.cuda.Event()
        event.record(side)
        return CudaWork(event, device, tensors, nccl, what)

    # ------------------------------------------------------------------ collectives
    def all_gather(self, output: Any, input: Any, async_op: bool = False) -> Any:
        """output (size * input.numel() elements) = every rank's input, in rank order."""
        if self._route("all_gather", ("output", output), ("input", input)):
            return self._cuda_op(
                "all_gather", lambda n, s: n.all_gather(output, input, stream=s), (output, input), async_op
            )
        return self._cpu_op("all_gather", async_op, (output, input), {})

    def reduce_scatter(self, output: Any, input: Any, op: str = "sum", async_op: bool = False) -> Any:
        """output = block ``rank`` (output.numel() elements) of the reduction of every rank's input."""
        if op.__class__ is not str:
            op = _rules.redop(op)
        if self._route("reduce_scatter", ("output", output), ("input", input)):
            return self._cuda_op(
                "reduce_scatter", lambda n, s: n.reduce_scatter(output, input, op, stream=s), (output, input), async_op
            )
        return self._cpu_op("reduce_scatter", async_op, (output, input), {"op": op})

    def all_reduce(self, tensor: Any, op: str = "sum", async_op: bool = False) -> Any:
        """In place: tensor = reduction (sum | avg | max | min, or their torch.distributed.ReduceOp)
        over ranks."""
        if op.__class__ is not str:
            op = _rules.redop(op)
        if self._route("all_reduce", ("tensor", tensor)):
            return self._cuda_op("all_reduce", lambda n, s: n.all_reduce(tensor, op, stream=s), (tensor,), async_op)
        return self._cpu_op("all_reduce", async_op, (tensor,), {"op": op})

    def broadcast(self, tensor: Any, root: int = 0, async_op: bool = False) -> Any:
        """In place: every rank's tensor = root's."""
        if self._route("broadcast", ("tensor", tensor)):
            return self._cuda_op("broadcast", lambda n, s: n.broadcast(tensor, root, stream=s), (tensor,), async_op)
        return self._cpu_op("broadcast", async_op, (tensor,), {"root": root})

    def reduce(self, tensor: Any, root: int = 0, op: str = "sum", async_op: bool = False) -> Any:
        """root's tensor = reduction over ranks; other ranks' tensors are left unchanged."""
        if op.__class__ is not str:
            op = _rules.redop(op)
        if self._route("reduce", ("tensor", tensor)):
            return self._cuda_op("reduce", lambda n, s: n.reduce(tensor, op, root, stream=s), (tensor,), async_op)
        return self._cpu_op("reduce", async_op, (tensor,), {"root": root, "op": op})

    def send(self, tensor: Any, dst: int, async_op: bool = False, tag: int = 0) -> Any:
        """Send to group rank ``dst``. On CPU the send completes once its data is in the shared
        buffers (small messages never wait for the receiver); to exchange in both directions, use
        :meth:`batch` or ``async_op=True``, which cannot deadlock whatever the order of issue.
        ``tag`` (an int32) travels with the message; the receiver's ``recv`` must give the same
        one. CUDA tensors (NCCL, which has no tags) take ``tag=0`` only."""
        if type(tag) is not int or tag:  # tag 0, the common case, costs nothing on the way to C
            tag = check_tag(tag, "send")
        if self._route("send", ("tensor", tensor)):
            return self._cuda_op("send", lambda n, s: n.send(tensor, dst, stream=s, tag=tag), (tensor,), async_op)
        return self._cpu_op("send", async_op, (tensor,), {"dst": dst, "tag": tag} if tag else {"dst": dst})

    def recv(self, tensor: Any, src: int, async_op: bool = False, tag: int = 0) -> Any:
        """Receive the next message from group rank ``src`` into tensor; it must have the numel,
        dtype and ``tag`` given here (messages between two ranks arrive in the order they were
        sent: a recv does not skip ahead to a later message with its tag, it raises
        DistributedError naming both tags, on both ranks)."""
        if type(tag) is not int or tag:
            tag = check_tag(tag, "recv")
        if self._route("recv", ("tensor", tensor)):
            return self._cuda_op("recv", lambda n, s: n.recv(tensor, src, stream=s, tag=tag), (tensor,), async_op)
        return self._cpu_op("recv", async_op, (tensor,), {"src": src, "tag": tag} if tag else {"src": src})

    def batch(self, ops: Sequence[Any], async_op: bool = False) -> Any:
        """Run several ops together: each a :class:`P2POp` or a tuple ``(name, *args)`` with the
        arguments of the method of that name (``("send", t, dst)``, ``("recv", t, src)``,
        ``("send", t, dst, tag)``, ``("all_reduce", t, "sum")``, ...). Sends and receives move at
        once (NCCL: one group), so a ring exchange issued in any order on the ranks completes;
        collectives of the batch run in list order. Returns one Work when ``async_op``."""
        items = batch_items(ops, self)
        if not items:
            raise ValueError("batch: argument 'ops' is empty; expected at least one op")
        named = [(f"ops[{i}]", a) for i, item in enumerate(items) for a in item[1:] if hasattr(a, "__dlpack__")]
        if named and self._route("batch", *named):
            tensors = tuple(t for _, t in named)
            return self._cuda_op("batch", lambda n, s: n.batch(items, stream=s), tensors, async_op)
        return self._cpu_op("batch", async_op, (items,), {})

    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Any:
        """Input's dim-0 block j (``input_split_sizes[j]`` rows; equal blocks if not given) goes to
        rank j; output's block i (``output_split_sizes[i]`` rows) comes from rank i: the meaning of
        torch.distributed.all_to_all_single. One op of the engine: a send and a recv with every
        peer, issued together (no order of issue can deadlock), and the copy of this rank's own
        block. Tensors: contiguous, at least 1-D, one dtype, rows of the same number of elements,
        not overlapping. Returns a Work when ``async_op``."""
        if self._route("all_to_all_single", ("output", output), ("input", input)):
            return self._cuda_op(
                "all_to_all_single",
                lambda n, s: n.all_to_all_single(output, input, output_split_sizes, input_split_sizes, stream=s),
                (output, input),
                async_op,
            )
        return self._cpu_op("all_to_all_single", async_op, (output, input, output_split_sizes, input_split_sizes), {})

    def all_to_all(self, outputs: Sequence[Any], inputs: Sequence[Any], async_op: bool = False) -> Any:
        """inputs[j] goes to rank j; outputs[i] comes from rank i (see _alltoall)."""
        return _alltoall.all_to_all(self, outputs, inputs, async_op)

    def barrier(self, async_op: bool = False) -> Any:
        """Every rank waits for all the others (CPU engine; also the NCCL one if it is in use)."""
        work = self._cpu_op("barrier", async_op, (), {})
        if self._nccl is not None:
            self._nccl.barrier()
        return work


# One engine group per (torch process group, role): (the torch group, the engine group).
REGISTRY: dict = {}


__all__ = ["Group", "REGISTRY", "StoreExchange", "gpu_identity", "hostname"]
