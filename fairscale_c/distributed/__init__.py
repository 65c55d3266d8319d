"""fairscale_c.distributed — collectives for FairScale-style training.

CPU tensors of ranks on one host go through a shared-memory engine written in C (a progress
thread per group runs ops with the GIL released); CUDA tensors go through NCCL. Groups are built
from an initialised ``torch.distributed`` process group, or from torchrun's environment::

    import fairscale_c.distributed as fdist
    group = fdist.init_group()            # default / given torch group, or torchrun env
    fdist.all_reduce(t, op="avg")         # uses the default group
    work = group.all_gather(out, inp, async_op=True); ...; work.wait()
    group.batch([fdist.P2POp("send", a, right), fdist.P2POp("recv", b, left)])  # cannot deadlock
    sub = group.new_group([0, 1])         # every rank of `group` calls it; others get None
    group.destroy()                       # or `with fdist.init_group() as group:`
    g = fdist.group_for(pg, role="reduce_scatter")  # the one engine group of (pg, role)

A Work behaves the same on both devices: ``wait()`` on CPU blocks until the op is done; on CUDA
the op runs on the group's side stream and ``wait()`` makes the current stream wait for it (no host
synchronisation); ``is_completed()`` polls either way.

Errors: ValueError/TypeError for bad arguments (raised before anything is sent);
``fairscale_c.DistributedError`` for a peer that dies, stalls past FAIRSCALE_C_TIMEOUT seconds
(default 600), or issues a different op. See docs/collectives.md.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
import warnings
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .._C import DistributedError
from .._C import Work as ShmWork
from ._group import REGISTRY, Group
from ._local import LocalGroup
from ._p2p import P2POp
from ._shared import is_shared
from ._shared import _DTYPES as _SHARED_DTYPES
from ._shared import shared_empty as _shared_empty
from ._rendezvous import ProcessGroupExchange, StoreExchange, default_store, env_store, timeout_s
from ._work import CompletedWork, CudaWork, local_copy

__all__ = [
    "DistributedError",
    "Group",
    "LocalGroup",
    "P2POp",
    "ShmWork",
    "CudaWork",
    "CompletedWork",
    "group_for",
    "batch_isend_irecv",
    "local_copy",
    "init_group",
    "new_group",
    "get_group",
    "destroy",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
    "all_to_all_single",
    "all_to_all",
    "timeout_s",
    "ranks_share_gpus",
    "shared_empty",
    "shared_zeros",
    "is_shared",
]

_default: Optional[Group] = None
_built: Dict[Any, int] = defaultdict(int)
_building = threading.Lock()  # guards _key_locks
_key_locks: Dict[Any, threading.Lock] = {}  # one per registry key (and the default group's): one build each
_env_store: Optional["dist.Store"] = None
# What torch.distributed.new_group returns on a rank outside the group.
_NON_GROUP_MEMBER = dist.GroupMember.NON_GROUP_MEMBER if dist.is_available() else object()


def init_group(pg: Optional["dist.ProcessGroup"] = None, *, name: Optional[str] = None, device: Any = None) -> Group:
    """The engine group of ``pg`` (a collective the first time: all ranks of ``pg`` call it in the
    same order).

    With torch.distributed initialised, ranks come from ``pg`` (default: the default group) and
    rendezvous data travel through torch's store (or object collectives on ``pg``); without a
    ``name`` this is the registry's group for ``pg`` (see :func:`group_for`), built once. With a
    ``name``, a new group of its own. Without torch.distributed, RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT (as set by torchrun) are used with a TCPStore. The first group built over every
    rank becomes the default for the module-level functions. ``device`` (a CUDA device) creates the group's NCCL
    communicator now instead of at its first CUDA op."""
    if name is None and dist.is_available() and dist.is_initialized():
        group = group_for(pg if pg is not None else dist.group.WORLD, device=device)
        if isinstance(group, LocalGroup):  # a one-rank torch group: still a real engine group here
            group = _build(pg, None)
            REGISTRY[(id(group.process_group), "default")] = (group.process_group, group)
        return group
    group = _build(pg, name)
    if device is not None:
        group.init_nccl(device)
    return group


def _key_prefix(gname: str) -> str:
    """The store keys of a group's rendezvous. torchrun's store outlives a restart of the workers
    (--max_restarts): the attempt number keeps a new attempt from reading the keys of the last."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"fairscale_c/{gname}" if attempt == "0" else f"fairscale_c/attempt{attempt}/{gname}"


def _lock_for(key: Any) -> threading.Lock:
    with _building:
        return _key_locks.setdefault(key, threading.Lock())


def _registry_name(pg: "dist.ProcessGroup", ranks: Tuple[int, ...], role: str) -> str:
    """The name of the registry's group for torch process group ``pg`` and ``role``: from torch's
    name of ``pg``, which every rank gives the same group (torch builds groups in one order on
    every rank), so two groups over the same ranks used first in a different order on different
    ranks still meet their own peers. The count tells apart the groups of a name that torch gives
    again after destroy_process_group and a new init_process_group."""
    tname = getattr(pg, "group_name", None) or dist.distributed_c10d._get_process_group_name(pg)
    members = ",".join(map(str, ranks)) if len(ranks) <= 8 else str(len(ranks))
    base = f"pg{tname}[{members}]" + ("" if role == "default" else f"/{role}")
    _built[base] += 1
    return base if _built[base] == 1 else f"{base}#{_built[base]}"


def _build(pg: Optional["dist.ProcessGroup"], name: Optional[str], role: str = "default") -> Group:
    global _default
    timeout_s()  # an invalid FAIRSCALE_C_TIMEOUT is a ValueError here, before any exchange
    if dist.is_available() and dist.is_initialized():
        pg = pg if pg is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(pg))
        gname = name or _registry_name(pg, ranks, role)
        store = default_store()
        if store is not None:
            rank = dist.get_rank(pg)
            exchange: Any = StoreExchange(store, _key_prefix(gname), rank, len(ranks), gname)
        else:
            exchange = ProcessGroupExchange(pg, gname)
        group = Group(exchange, gname, pg)
        whole_world = ranks == tuple(range(dist.get_world_size())) and role == "default"
    else:
        if pg is not None:
            raise ValueError("init_group: pg was given but torch.distributed is not initialised")
        _built[()] += 1
        gname = name or f"world{_built[()]}"
        global _env_store
        if _env_store is None:
            _env_store = env_store()  # one per process: every env-built group shares it
        store = _env_store
        exchange = StoreExchange(
            store, _key_prefix(gname), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), gname
        )
        group = Group(exchange, gname, None)
        whole_world = True
    if _default is None and whole_world:  # group=None means every rank, as in torch.distributed
        _default = group
    return group


def require_initialised_world(what: str) -> None:
    """For a feature given no process group while torch.distributed is not initialised: raise if
    this process is one of several launched ranks (WORLD_SIZE > 1, as torchrun sets), where the
    world size of one that the feature would take has every rank train alone."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if size > 1:
        raise RuntimeError(
            f"{what}: this process is one of WORLD_SIZE={size} ranks (a launch such as torchrun) but "
            "torch.distributed is not initialised, so there is no default group to work over; call "
            "torch.distributed.init_process_group() first (as with FairScale). Without it every rank "
            "would run alone, at world size 1"
        )


def group_for(
    process_group: Any = None,
    role: str = "default",
    *,
    device: Any = None,
    argument: str = "group_for: argument 'process_group'",
) -> Any:
    """The one engine group of a torch process group and role, built on first use (a collective
    over that group; every rank asks in the same order). ``None`` means the default group; with
    torch.distributed not initialised, or for a group of one rank, a :class:`LocalGroup` (every
    collective a local copy). Features share these: FSDP takes ``"default"`` for its all-gathers
    and ``"reduce_scatter"`` for gradient reductions (a communicator of its own, so the two run
    side by side, as with FairScale's separate reduce-scatter group). ``device``: create the NCCL
    communicator now (Pipe and OSS ask for it).

    A process group wrapped by a tracker (an object with ``traced_process_group``, such as
    layer_memory_tracker's ProcessGroupTracker) gets the wrapped group's engine group.

    As in FairScale, ``process_group`` may also be any object with ``rank()`` and ``size()`` (a
    stand-in for a torch process group): of size 1 it gets a :class:`LocalGroup` and needs no
    torch.distributed at all; of a larger size it is a ValueError, since only a torch process
    group can carry collectives across processes. ``argument`` names ``process_group`` in
    those errors as the caller's user knows it (e.g. "OSS: argument 'group'")."""
    traced = getattr(process_group, "traced_process_group", None)
    if traced is not None:  # a tracker around a process group (layer_memory_tracker.ProcessGroupTracker)
        return group_for(traced, role, device=device, argument=argument)
    if process_group is not None and not _is_torch_group(process_group):
        return _stand_in_group(process_group, role, argument)
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return LocalGroup()
        process_group = dist.group.WORLD
    key = (id(process_group), role)
    entry = REGISTRY.get(key)
    if entry is None:
        # Threads asking at once get one group: the first builds it, the others wait for it (a
        # lock per key, so that groups that different threads build meet their peers in any order).
        with _lock_for(key):
            entry = REGISTRY.get(key)
            if entry is None:
                with _building:
                    _release_destroyed_groups()
                if dist.get_world_size(process_group) == 1:
                    group: Any = LocalGroup(process_group)
                else:
                    group = _build(process_group, None, role)
                REGISTRY[key] = entry = (process_group, group)
    group = entry[1]
    if device is not None and not isinstance(group, LocalGroup):
        group.init_nccl(device)
    return group


def ranks_share_gpus(group: Any = None) -> bool:
    """Whether CUDA ranks share a GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1): two ranks
    of `group` (an engine group) found their current CUDA device to be the same GPU when the group
    was built (both had initialised CUDA by then), or this node runs more ranks than it has GPUs
    (torchrun's LOCAL_WORLD_SIZE against torch's device count). False where neither is known.
    There, a second NCCL communicator per rank can deadlock when the ranks' kernels run at the same
    time (MPS; docs/fsdp.md), which is why FSDP then keeps its reduce-scatters on its all-gathers'
    group."""
    import torch

    if getattr(group, "shares_gpu", False):
        return True
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or not torch.cuda.is_available():
        return False
    return int(local) > torch.cuda.device_count()


def _is_torch_group(pg: Any) -> bool:
    return dist.is_available() and isinstance(pg, dist.ProcessGroup)


def _stand_in_group(pg: Any, role: str, argument: str) -> LocalGroup:
    """The engine group of a process-group stand-in (an object with rank() and size())."""
    what = f"{argument} ({type(pg).__name__})"
    if not (callable(getattr(pg, "rank", None)) and callable(getattr(pg, "size", None))):
        raise TypeError(f"{what} must be a torch.distributed process group, None, or an object with rank() and size()")
    rank, size = pg.rank(), pg.size()
    if (
        not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, size))
        or size < 1
        or not 0 <= rank < size
    ):
        raise ValueError(f"{what} reports rank()={rank!r}, size()={size!r}; expected ints with 0 <= rank < size")
    if size != 1:
        raise ValueError(
            f"{what} is not a torch.distributed process group and has size {size}; such a stand-in "
            "is usable only at size 1 (collectives across processes need a torch.distributed process group)"
        )
    return LocalGroup(pg, name=f"local/{role}")  # stateless: not kept in the registry


def _release_destroyed_groups() -> None:
    """Destroy the engine groups of torch process groups that torch has destroyed, so a process
    that initialises and destroys torch.distributed repeatedly (sweeps, test suites) does not keep
    a progress thread and a shared-memory mapping per past process group. Runs where every rank
    builds its next group, so every rank releases the same ones."""
    live = _live_process_groups()
    if live is None:  # a torch without this registry: keep everything
        return
    for key, (pg, group) in list(REGISTRY.items()):
        if pg not in live:
            REGISTRY.pop(key, None)
            _key_locks.pop(key, None)
            group.destroy()


class _NonMember(Exception):
    """``group`` is torch.distributed's NON_GROUP_MEMBER: this rank is outside the process group."""


def _torch_shaped(fn: Any) -> Any:
    """A module-level function called on a rank outside ``group`` (torch.distributed gives such a
    rank ``GroupMember.NON_GROUP_MEMBER`` from ``new_group``) does nothing and returns None (recv
    -1), with a warning, as torch.distributed's do."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(map(_without_autograd, args))
        kwargs = {k: _without_autograd(v) for k, v in kwargs.items()}
        try:
            return fn(*args, **kwargs)
        except _NonMember:
            warnings.warn(
                f"fairscale_c.distributed.{fn.__name__}: this rank is not in the process group; nothing to do",
                stacklevel=2,
            )
            return {"recv": -1, "batch_isend_irecv": []}.get(fn.__name__)

    return call


def _same_group(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are one group: the same object, or a torch process group and its engine
    group."""
    return a is b or getattr(a, "process_group", None) is b or getattr(b, "process_group", None) is a


def _without_autograd(arg: Any) -> Any:
    """torch.distributed's functions take tensors that require grad (a Parameter broadcast from
    rank 0) and read or write their memory unseen by autograd; the engine takes tensors without
    autograd history: such a tensor (alone, or in a list) is passed as its detached alias."""
    if getattr(arg, "requires_grad", False):
        return arg.detach()
    if isinstance(arg, (list, tuple)) and any(getattr(t, "requires_grad", False) for t in arg):
        return [t.detach() if getattr(t, "requires_grad", False) else t for t in arg]
    return arg


@_torch_shaped
def batch_isend_irecv(p2p_op_list: Sequence[P2POp], group: Any = None) -> List[Any]:
    """torch.distributed.batch_isend_irecv's shape: run the sends and recvs together (no order of
    issue deadlocks) and return a list with one Work for them. The group is ``group``, else the
    one the P2POps name (all the same one, as torch requires), else the default group."""
    ops = list(p2p_op_list)
    named = {id(op.group): op.group for op in ops if isinstance(op, P2POp) and op.group is not None}
    if group is None:
        unnamed = any(isinstance(op, P2POp) and op.group is None for op in ops)
        if len(named) > 1 or (named and unnamed):
            raise ValueError(
                "batch_isend_irecv: the P2POps name different groups (group=None is the default group); "
                "expected one group for all"
            )
        group = next(iter(named.values()), None)
    elif any(not _same_group(g, group) for g in named.values()):
        raise ValueError("batch_isend_irecv: a P2POp names another group than argument 'group'; expected one group")
    ops = [
        P2POp(op.op, op.tensor.detach(), op.peer, op.group, op.tag)
        if isinstance(op, P2POp) and getattr(op.tensor, "requires_grad", False)
        else op
        for op in ops
    ]
    if _is_torch_group(group):  # torch's P2POp peers are global ranks
        ops = [
            (op.op, op.tensor, _group_rank(group, op.peer, f"P2POp {i}: peer", "batch_isend_irecv"), op.tag)
            if isinstance(op, P2POp)
            else op
            for i, op in enumerate(ops)
        ]
    return [_resolve(group).batch(ops, async_op=True)]


def get_group() -> Group:
    """The default group (the first built over every rank), building it if needed. A default that
    was destroyed, or whose torch process group torch has destroyed (destroy_process_group and a
    new init_process_group), is replaced by the group of the current one."""
    global _default
    if _default is not None and not _still_every_rank(_default):
        if _default._pg_built and not (dist.is_available() and dist.is_initialized()):
            # not torchrun's environment: the rendezvous would find torch's old store on its port
            raise RuntimeError(
                "fairscale_c.distributed: the default group's torch.distributed process group was destroyed "
                "(destroy_process_group) and torch.distributed is not initialised now; call "
                "init_process_group again, or pass a group"
            )
        _default = None
    if _default is not None:
        return _default
    with _lock_for("default"):  # threads asking at once get one default group
        return _default if _default is not None else init_group()


def _still_every_rank(group: Group) -> bool:
    if group._closed:
        return False
    pg = group.process_group
    if pg is None:  # built from torchrun's environment
        return True
    live = _live_process_groups()
    return live is None or pg in live


def _live_process_groups() -> Any:
    """torch's registry of the process groups it has not destroyed (None where torch has none)."""
    return getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)


def new_group(ranks: Optional[Sequence[int]] = None, group: Optional[Group] = None) -> Optional[Group]:
    """Subgroup of ``ranks`` (ranks of ``group``, default: the default group; None: all of its
    ranks); see Group.new_group."""
    if group is not None and not isinstance(group, Group):
        raise TypeError(
            f"new_group: argument 'group' must be a fairscale_c.distributed Group or None, got {type(group).__name__} "
            "(for a torch.distributed process group, build the subgroup with torch.distributed.new_group and pass it "
            "as 'group' to the functions here)"
        )
    return (group or get_group()).new_group(ranks)


def destroy(group: Optional[Group] = None) -> None:
    """Destroy ``group`` (default: the default group, which is then forgotten)."""
    global _default
    target = group or _default
    if target is None:
        return
    target.destroy()
    if target is _default:
        _default = None


def _resolve(group: Any) -> Any:
    """The engine group a module-level function runs on: ``group`` itself, the default group for
    None, or the engine group of a torch.distributed process group (see :func:`group_for`)."""
    if group is None:
        return get_group()
    if isinstance(group, (Group, LocalGroup)):
        return group
    if isinstance(group, int) and not isinstance(group, bool) and group == _NON_GROUP_MEMBER:
        raise _NonMember()
    if _is_torch_group(group) or hasattr(group, "traced_process_group"):
        return group_for(group)
    raise TypeError(
        f"argument 'group' must be a fairscale_c.distributed group, a torch.distributed process group "
        f"or None, got {type(group).__name__}"
    )


def _group_rank(group: Any, rank: Any, arg: str, fn: str) -> int:
    """``rank`` as a rank of the engine group: as given for a group of this module (ranks of the
    group), translated from a global rank for a torch.distributed process group, as
    torch.distributed's functions take it there."""
    if not _is_torch_group(group):
        return rank
    try:
        rank = operator.index(rank)
    except TypeError:
        raise TypeError(f"{fn}: argument '{arg}' must be an int (a global rank), got {type(rank).__name__}") from None
    try:
        got = dist.get_group_rank(group, rank)
        if 0 <= got < dist.get_world_size(group):  # torch takes any rank of the default group as is
            return got
    except (ValueError, RuntimeError):
        pass
    raise ValueError(
        f"{fn}: {arg}={rank} is not a rank of the process group; with a torch.distributed process group as "
        f"'group', ranks are global ranks, as in torch.distributed (its ranks: {dist.get_process_group_ranks(group)})"
    )


def _complete_into(work: Any, copy: Any, async_op: bool) -> Any:
    """Run ``copy`` once ``work`` is done. The copy needs the gathered data, so an asynchronous
    call waits here as well and returns a completed Work (the list form does not overlap)."""
    if async_op:
        work.wait()
    copy()
    return CompletedWork() if async_op else None


@_torch_shaped
def all_gather(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's ``input`` into ``output``: one tensor of world × input's elements (as
    torch.distributed.all_gather_into_tensor), or torch.distributed.all_gather's list of one tensor
    per rank."""
    if isinstance(output, (list, tuple)):
        import torch

        for i, out in enumerate(output):
            if not isinstance(out, torch.Tensor) or (out.dtype, out.shape) != (input.dtype, input.shape):
                got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"all_gather: output[{i}] must be a tensor of the input's dtype and shape "
                    f"({input.dtype} {tuple(input.shape)}), got {got}"
                )
        flat = torch.empty((len(output),) + tuple(input.shape), dtype=input.dtype, device=input.device)
        work = _resolve(group).all_gather(flat, input, async_op=async_op)

        def copy() -> None:
            for out, got in zip(output, flat):
                out.copy_(got)

        return _complete_into(work, copy, async_op)
    return _resolve(group).all_gather(output, input, async_op=async_op)


@_torch_shaped
def reduce_scatter(output: Any, input: Any, op: Any = "sum", group: Any = None, async_op: bool = False) -> Any:
    """This rank's block of the reduced ``input``: one tensor of world × output's elements (as
    torch.distributed.reduce_scatter_tensor), or torch.distributed.reduce_scatter's list of one
    tensor per rank."""
    if isinstance(input, (list, tuple)):
        import torch

        input = torch.cat([t.reshape(-1) for t in input])
    return _resolve(group).reduce_scatter(output, input, op=op, async_op=async_op)


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """torch.distributed.all_gather_into_tensor: :func:`all_gather` into one tensor."""
    return all_gather(output_tensor, input_tensor, group, async_op)


def reduce_scatter_tensor(output: Any, input: Any, op: Any = "sum", group: Any = None, async_op: bool = False) -> Any:
    """torch.distributed.reduce_scatter_tensor: :func:`reduce_scatter` from one tensor."""
    return reduce_scatter(output, input, op, group, async_op)


@_torch_shaped
def all_reduce(tensor: Any, op: Any = "sum", group: Any = None, async_op: bool = False) -> Any:
    """In place over the ranks of ``group``: ``op`` is "sum", "avg", "max", "min" or their
    torch.distributed.ReduceOp."""
    return _resolve(group).all_reduce(tensor, op=op, async_op=async_op)


@_torch_shaped
def broadcast(tensor: Any, root: int = 0, group: Any = None, async_op: bool = False, *, src: Any = None) -> Any:
    """From rank ``root`` of ``group`` (a global rank when ``group`` is a torch.distributed process
    group, as torch.distributed.broadcast's ``src``, which may be given by that name too)."""
    root = _group_rank(group, root if src is None else src, "root" if src is None else "src", "broadcast")
    return _resolve(group).broadcast(tensor, root=root, async_op=async_op)


@_torch_shaped
def reduce(
    tensor: Any, root: int = 0, op: Any = "sum", group: Any = None, async_op: bool = False, *, dst: Any = None
) -> Any:
    """Onto rank ``root`` of ``group`` (a global rank when ``group`` is a torch.distributed process
    group, as torch.distributed.reduce's ``dst``, which may be given by that name too)."""
    root = _group_rank(group, root if dst is None else dst, "root" if dst is None else "dst", "reduce")
    return _resolve(group).reduce(tensor, root=root, op=op, async_op=async_op)


@_torch_shaped
def send(tensor: Any, dst: int, group: Any = None, tag: int = 0, *, async_op: bool = False) -> Any:
    """Send to rank ``dst`` of ``group``; the positional order of torch.distributed.send
    (tensor, dst, group, tag). A Work with ``async_op=True`` (or use :func:`isend`). With a
    torch.distributed process group as ``group``, ``dst`` is a global rank, as in torch."""
    return _resolve(group).send(tensor, _group_rank(group, dst, "dst", "send"), async_op=async_op, tag=tag)


@_torch_shaped
def recv(tensor: Any, src: int, group: Any = None, tag: int = 0, *, async_op: bool = False) -> Any:
    """Receive from rank ``src`` of ``group`` into ``tensor``; the positional order of
    torch.distributed.recv (tensor, src, group, tag), and like it returns the sender's rank
    (a Work with ``async_op=True``, or use :func:`irecv`). ``src`` is required: the engine matches
    messages by sender. With a torch.distributed process group as ``group``, ``src`` (and the rank
    returned) is a global rank, as in torch."""
    work = _resolve(group).recv(tensor, _group_rank(group, src, "src", "recv"), async_op=async_op, tag=tag)
    return work if async_op else src


@_torch_shaped
def isend(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> Any:
    """torch.distributed.isend: :func:`send` with ``async_op=True``; returns its Work."""
    return _resolve(group).send(tensor, _group_rank(group, dst, "dst", "isend"), async_op=True, tag=tag)


@_torch_shaped
def irecv(tensor: Any, src: int, group: Any = None, tag: int = 0) -> Any:
    """torch.distributed.irecv: :func:`recv` with ``async_op=True``; returns its Work."""
    return _resolve(group).recv(tensor, _group_rank(group, src, "src", "irecv"), async_op=True, tag=tag)


@_torch_shaped
def barrier(group: Any = None, async_op: bool = False) -> Any:
    return _resolve(group).barrier(async_op=async_op)


@_torch_shaped
def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """torch.distributed.all_to_all_single's meaning: input's dim-0 block j (``input_split_sizes[j]``
    rows, or an equal split) goes to rank j, output's block i comes from rank i. One batch of sends
    and receives underneath: it cannot deadlock, on CPU and on CUDA."""
    return _resolve(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op=async_op)


@_torch_shaped
def all_to_all(
    output_tensor_list: Sequence[Any],
    input_tensor_list: Sequence[Any],
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """torch.distributed.all_to_all's meaning: ``input_tensor_list[j]`` goes to rank j,
    ``output_tensor_list[i]`` comes from rank i."""
    return _resolve(group).all_to_all(output_tensor_list, input_tensor_list, async_op=async_op)


def shared_empty(*size: Any, dtype: Any = None, group: Optional[Group] = None) -> Any:
    """A zero-filled, contiguous CPU tensor of ``size`` (ints, or one sequence of them) and
    ``dtype`` (default torch.float32) in memory that every rank of ``group`` (default: the default
    group) maps. A collective: every rank calls it with the same size and dtype, in the same order
    as its other group set-up calls.

    A collective whose buffers on every rank lie in the same such allocation (each rank passes its
    own tensor, or views of it) copies straight between the ranks' memory: each byte moves once,
    at memcpy speed, at every size from 1 MiB (docs/collectives.md, "Shared tensors"). Other
    tensors work as before. Like ``Tensor.share_memory_()``, the memory is also shared with
    processes forked afterwards. On one rank, or where the ranks may not map each other's memory
    (a RuntimeWarning says why), it returns an ordinary tensor; :func:`is_shared` tells which."""
    import torch

    return _shared_empty(*size, dtype=torch.float32 if dtype is None else dtype, group=group or get_group())


def shared_zeros(numel: int, *, dtype: Any, device: Any, group: Group) -> Any:
    """A zeroed 1-D buffer of ``numel`` elements for collectives on ``group``: on CPU with peers on
    this host a :func:`shared_empty` tensor (an ordinary one, without a warning, where the system
    refuses shared memory), elsewhere, and for dtypes the collectives do not take,
    ``torch.zeros``. What the features allocate their long-lived communication buffers with
    (FSDP's shards, OSS's parameter buffers, ShardedDataParallel's gradient buckets). A
    collective on CPU: every rank calls it with the same arguments."""
    import warnings

    import torch

    if isinstance(numel, bool) or not isinstance(numel, int):
        raise TypeError(f"shared_zeros: numel is {numel!r}; expected an int >= 0")
    if numel < 0:
        raise ValueError(f"shared_zeros: numel is {numel!r}; expected an int >= 0")
    if not isinstance(group, (Group, LocalGroup)):
        raise TypeError(
            f"shared_zeros: group is {type(group).__name__}; expected a fairscale_c.distributed Group "
            "(init_group, group_for)"
        )
    if torch.device(device).type == "cpu" and group.size > 1 and dtype in _SHARED_DTYPES:
        with warnings.catch_warnings():  # refused by the system: an ordinary tensor, the other paths
            warnings.simplefilter("ignore", RuntimeWarning)
            return _shared_empty(numel, dtype=dtype, group=group)
    return torch.zeros(numel, dtype=dtype, device=device)
