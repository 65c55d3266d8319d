"""OSS: optimizer-state sharding (ZeRO-1) for any ``torch.optim.Optimizer``, FairScale 0.4.13's API.

Every rank holds all parameters but steps, and keeps optimizer state for, only its own partition
(FairScale's greedy partition, per parameter group, so partitions and state dicts match FairScale's).
After the step each owner's updated parameters reach the other ranks through
``fairscale_c.distributed``: trainable parameters are views of one flat buffer per (device, dtype)
in which every rank's parameters are one contiguous block, so the exchange is one collective per
buffer and rank: on CPU one broadcast per rank, in descending rank order, those of the ranks above
this one issued before this rank's optimizer step (they travel while it steps); on CUDA (and with
``broadcast_fp16``) an in-place all-gather when the blocks are near-equal, else one broadcast per
rank.

Beyond FairScale: ``clip_grad_norm`` reduces over the OSS group (FairScale uses the world group);
``consolidate_state_dict`` moves one rank's shard at a time as one flat buffer and never holds more
than the result plus one shard; a consolidated state dict loads at any world size.
"""

from __future__ import annotations

import functools
import logging
import operator
import warnings
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch.optim import SGD, Optimizer

from fairscale_c import distributed as fdist
from fairscale_c.internal.params import grad_norm_term, norm_dtype, reduce_norm_term

from ._blocked import stepped_in_blocks
from ._oss_state import PER_ELEMENT_STATE, copy_state, merge_shards, pack, to_cpu, unpack

__all__ = ["OSS"]

_log = logging.getLogger(__name__)

# Padding an all-gather's blocks to the largest rank's block is accepted when it adds at most this
# fraction of the buffer's real size; otherwise each rank's block is broadcast from its owner.
_MAX_GATHER_PADDING = 1 / 16


@dataclass
class _ParamBuffer:
    """Trainable parameters of one (device, dtype), as views of ``flat``: rank r's parameters are
    ``flat[starts[r] : starts[r] + lengths[r]]``. With ``stride`` set every block starts at
    ``r * stride`` and one in-place all-gather refreshes them all."""

    device: torch.device
    dtype: torch.dtype
    flat: torch.Tensor
    starts: List[int]
    lengths: List[int]
    stride: Optional[int]
    params: List[torch.Tensor] = field(default_factory=list)
    half: Optional[torch.Tensor] = None  # the float16 wire buffer of broadcast_fp16

    def block(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        return t[self.starts[rank] : self.starts[rank] + self.lengths[rank]]


def _check_optim(optim: Any) -> None:
    target = optim.func if isinstance(optim, functools.partial) else optim
    if isinstance(target, type) and issubclass(target, Optimizer):
        return
    got = f"an instance of {type(optim).__name__}" if isinstance(optim, Optimizer) else repr(optim)
    raise TypeError(f"OSS: argument 'optim' must be a torch.optim.Optimizer subclass (the class itself), got {got}")


def _group_rank_size(group: Any) -> Tuple[int, int]:
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        fdist.require_initialised_world("OSS(group=None)")
        return 0, 1
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return dist.get_rank(group), dist.get_world_size(group)
    comm = fdist.group_for(group, argument="OSS: argument 'group'")  # a stand-in with rank()/size()
    return comm.rank, comm.size


class OSS(Optimizer):
    """Wraps an optimizer class and shards its state over the ranks of ``group``::

        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)

    ``optim`` is the inner optimizer class, built on this rank's partition with ``**default``.
    ``group``: a torch.distributed process group (default: the world), or an object with
    ``rank()`` / ``size()`` of size 1. ``broadcast_buffer_size`` is accepted and unused (as in
    FairScale); ``broadcast_fp16`` sends float32 parameters as float16 (every rank, the owner
    included, then holds the float16-rounded values, as in FairScale); ``force_broadcast_object``
    is accepted for compatibility (state consolidation never uses pickled broadcasts of tensors).

    After changing ``requires_grad`` of parameters call :meth:`refresh_trainable` on every rank.
    """

    optim: Optimizer
    in_super_constructor: bool

    def __init__(
        self,
        params: Any,
        optim: Type[Optimizer] = SGD,
        group: Optional[Any] = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        **default: Any,
    ) -> None:
        _check_optim(optim)
        self._partitions: List[List[dict]] = []
        self._param_rank: Dict[torch.Tensor, int] = {}
        self._device_params: Dict[torch.device, List[List[torch.Tensor]]] = {}
        self._index_of: Dict[int, int] = {}
        self.in_super_constructor = True
        super().__init__(params, default)
        self.in_super_constructor = False

        self._optim_defaults = default
        self._optim_constructor = optim
        self.group = dist.group.WORLD if group is None and dist.is_available() and dist.is_initialized() else group
        self.rank, self.world_size = _group_rank_size(group)
        self.comm = fdist.group_for(group, argument="OSS: argument 'group'")
        self.global_rank = (
            dist.get_global_rank(group, self.rank)
            if dist.is_available() and isinstance(group, dist.ProcessGroup)
            else self.rank
        )
        self.broadcast_buffer_size = broadcast_buffer_size
        self.broadcast_fp16 = bool(broadcast_fp16)
        self.force_broadcast_object = bool(force_broadcast_object)
        self.buckets: List[_ParamBuffer] = []
        self._consolidated: Optional[Dict[int, Any]] = None
        self._default_device = torch.device("cpu")
        self.refresh_trainable()

    def __copy__(self) -> "OSS":
        """A shallow copy shares everything (the inner optimizer, the group), as Python's default."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __getstate__(self) -> Dict[str, Any]:
        # torch's Optimizer pickles only defaults, state and param_groups: a copy of an OSS would
        # lack its inner optimizer and group, and fail at its first step
        raise TypeError(
            "OSS cannot be pickled or deep-copied: its shard is bound to a live process group. Save "
            "local_state_dict(), or consolidate_state_dict() then state_dict(), and load it into a new OSS"
        )

    # ------------------------------------------------------------------ partitioning

    def partition_parameters(self) -> List[List[dict]]:
        """Per rank, its param groups (copies of ``param_groups`` holding only its parameters):
        FairScale's greedy split, each parameter to the rank with the fewest elements so far
        (a frozen parameter counts 1), group by group with the running sizes carried over."""
        if not self._partitions:
            self._partitions = [[] for _ in range(self.world_size)]
            sizes = [0] * self.world_size
            for group in self.param_groups:
                self._partition_group(group, sizes)
        return self._partitions

    def _partition_group(self, group: dict, sizes: List[int]) -> None:
        per_rank: List[List[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for p in group["params"]:
            r = sizes.index(min(sizes))
            per_rank[r].append(p)
            sizes[r] += p.numel() if p.requires_grad else 1
        for r, params in enumerate(per_rank):
            shard = dict(group)
            shard["params"] = params
            self._partitions[r].append(shard)

    @property
    def param_to_rank(self) -> Dict[torch.Tensor, int]:
        """Each parameter's owner rank."""
        if not self._param_rank:
            for r, groups in enumerate(self.partition_parameters()):
                for g in groups:
                    for p in g["params"]:
                        self._param_rank[p] = r
        return self._param_rank

    @property
    def per_device_params(self) -> Dict[torch.device, List[List[torch.Tensor]]]:
        """device -> per rank, the parameters it owns on that device, sorted by size (stable)."""
        if not self._device_params:
            owner = self.param_to_rank
            for group in self.param_groups:
                for p in group["params"]:
                    lists = self._device_params.setdefault(p.device, [[] for _ in range(self.world_size)])
                    lists[owner[p]].append(p)
            for lists in self._device_params.values():
                for params in lists:
                    params.sort(key=lambda t: t.numel())
        return self._device_params

    # FairScale's private names, which code written against it reads.
    _param_to_rank = param_to_rank
    _per_device_params = per_device_params

    @property
    def _param_to_index(self) -> Dict[int, int]:
        if not self._index_of:
            self._index_of = {id(p): i for i, p in enumerate(chain(*(g["params"] for g in self.param_groups)))}
        return self._index_of

    @property
    def _local_params(self) -> List[torch.Tensor]:
        """The parameters this rank owns that have a gradient."""
        return [p for lists in self.per_device_params.values() for p in lists[self.rank] if p.grad is not None]

    def _clear_cache(self) -> None:
        self._partitions = []
        self._param_rank = {}
        self._device_params = {}
        self._index_of = {}

    # ------------------------------------------------------------------ param groups

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group on every rank (collective in effect: all ranks must call it). Existing
        parameters keep their owners; the new group's are placed greedily after them."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if isinstance(params, torch.Tensor):
            params = [params]
        if params is not None and not isinstance(params, set):
            params = list(params)
            seen = {id(p) for g in self.param_groups for p in g["params"]}
            twice = [i for i, p in enumerate(params) if id(p) in seen]
            if twice or len({id(p) for p in params}) != len(params):
                raise ValueError(
                    "OSS.add_param_group: argument 'param_group' lists a parameter that is already in another "
                    f"param group (or twice in this one), at position(s) {twice or 'within the group'}; "
                    "each parameter may belong to exactly one group"
                )
            meta = [i for i, p in enumerate(params) if isinstance(p, torch.Tensor) and p.is_meta]
            if meta:
                where = "OSS: argument 'params'"
                if not self.in_super_constructor:
                    where = "OSS.add_param_group: argument 'param_group'"
                raise ValueError(
                    f"{where} holds parameters on the meta device (position(s) {meta}); "
                    "materialise the module (module.to_empty(device=...), then initialise the values) "
                    "before building the optimizer"
                )
            param_group = dict(param_group, params=params)
        super().add_param_group(param_group)
        if self.in_super_constructor:
            return
        partitions = self.partition_parameters()  # owners of the earlier groups, unchanged
        sizes = [0] * self.world_size
        for r, groups in enumerate(partitions):
            sizes[r] = sum(p.numel() if p.requires_grad else 1 for g in groups for p in g["params"])
        self._partition_group(self.param_groups[-1], sizes)
        self._param_rank, self._device_params, self._index_of = {}, {}, {}
        self.optim.add_param_group(partitions[self.rank][-1])
        self._setup_flat_buffers()

    @staticmethod
    def _sync_param_groups(source: List[dict], destination: List[dict]) -> None:
        """Copy every option but ``params`` group by group (LR schedulers edit ``param_groups``)."""
        for src, dst in zip(source, destination):
            for k, v in src.items():
                if k != "params":
                    dst[k] = v

    def refresh_trainable(self) -> None:
        """Rebuild the exchange buffers after parameters were frozen or unfrozen (every rank)."""
        devices = list(self.per_device_params.keys())
        if not devices:
            raise ValueError("OSS: argument 'params' holds no parameters")
        self._default_device = devices[0]
        if not hasattr(self, "optim"):
            self.optim = self._optim_constructor(self.partition_parameters()[self.rank], **self._optim_defaults)
            OSS._sync_param_groups(self.optim.param_groups, self.param_groups)
            # The inner optimizer's defaults (betas, momentum, ...) as well as the ones given here,
            # as a plain optimizer has them: LR schedulers read them (OneCycleLR: momentum or betas).
            self.defaults = {**self.optim.defaults, **self.defaults}
            if self.world_size > 1 and isinstance(self.optim, torch.optim.LBFGS):
                warnings.warn(
                    "OSS: LBFGS on a rank's partition is not LBFGS on the whole model (each rank's line search and "
                    "history see its own parameters only): the steps differ from a single process's, as in FairScale",
                    stacklevel=3,
                )
        self._setup_flat_buffers()

    @torch.inference_mode(False)  # the buffers hold trainable parameters, whatever mode calls it
    @torch.no_grad()
    def _setup_flat_buffers(self) -> None:
        keyed: Dict[Tuple[torch.device, torch.dtype], List[List[torch.Tensor]]] = {}
        old = {b.flat.untyped_storage().data_ptr() for b in self.buckets}
        # this rank's parameters the exchange does not carry (frozen): step() keeps them unchanged
        self._unexchanged: List[torch.Tensor] = []
        for device, lists in self.per_device_params.items():
            for r, params in enumerate(lists):
                for p in params:
                    if p.requires_grad:
                        keyed.setdefault((device, p.dtype), [[] for _ in range(self.world_size)])[r].append(p)
                        continue
                    if r == self.rank:
                        self._unexchanged.append(p)
                    if p.untyped_storage().data_ptr() in old:
                        p.data = p.data.detach().clone()  # leaves a buffer it no longer belongs to
        buckets = []
        for (device, dtype), lists in keyed.items():
            lengths = [sum(p.numel() for p in params) for params in lists]
            total = sum(lengths)
            longest = max(lengths)
            padded = self.world_size > 1 and longest * self.world_size - total <= total * _MAX_GATHER_PADDING
            if padded:
                starts, size = [r * longest for r in range(self.world_size)], longest * self.world_size
            else:
                starts, size = [sum(lengths[:r]) for r in range(self.world_size)], total
            # on CPU in a shared tensor: each owner's broadcast of its block is then copied by the
            # peers straight from its memory
            flat = fdist.shared_zeros(size, dtype=dtype, device=device, group=self.comm)
            bucket = _ParamBuffer(device, dtype, flat, starts, lengths, longest if padded else None)
            for r, params in enumerate(lists):
                offset = starts[r]
                for p in params:
                    n = p.numel()
                    view = flat[offset : offset + n].view_as(p)
                    view.copy_(p.data)
                    p.data = view
                    bucket.params.append(p)
                    offset += n
            buckets.append(bucket)
        self.buckets = buckets

    def _buffers_current(self) -> bool:
        """Whether every trainable parameter still lives in its buffer (not moved by .to() etc.)."""
        for b in self.buckets:
            ptr = b.flat.untyped_storage().data_ptr()
            if b.params[0].untyped_storage().data_ptr() != ptr or b.params[-1].untyped_storage().data_ptr() != ptr:
                return False
        return True

    # ------------------------------------------------------------------ step

    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:
        """Step this rank's partition (extra keyword arguments go to the inner optimizer), then
        refresh every rank's copy of the updated parameters. Collective: every rank calls it."""
        OSS._sync_param_groups(self.param_groups, self.optim.param_groups)
        first = next(p for g in self.param_groups for p in g["params"])
        if self._default_device.type != first.device.type or not self._buffers_current():
            _log.info("OSS: parameters moved since the buffers were built; rebuilding them")
            self._device_params = {}  # owners stay; only the device grouping and buffers are rebuilt
            self.refresh_trainable()
        early = self._receive_early() if closure is None else None
        # A frozen parameter is in no exchange buffer: were its owner to step it (a gradient left
        # from before it was frozen, with momentum or weight decay), the other ranks' copies
        # would never follow. Its gradient is out of the inner optimizer's sight meanwhile, and
        # in the closure's (which may zero or replace it) as it is.
        frozen = self._unexchanged
        held: Dict[int, Optional[torch.Tensor]] = {}

        def hide() -> None:
            for p in frozen:
                held[id(p)], p.grad = p.grad, None

        def show() -> None:
            for p in frozen:
                p.grad = held.pop(id(p), p.grad)

        if frozen and closure is not None:
            inner_closure = closure

            def closure() -> Any:
                show()
                try:
                    return inner_closure()
                finally:
                    hide()

        hide()
        try:
            with stepped_in_blocks(self.optim):
                loss = self.optim.step(closure=closure, **kwargs) if closure is not None else self.optim.step(**kwargs)
        finally:
            show()
        self._broadcast_params(early)
        OSS._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _ordered_exchange(self) -> bool:
        """Whether the exchange is one broadcast per rank and bucket, ranks in descending order,
        those of ranks above this one issued before this rank's step (see _receive_early). On CPU
        only (the shared-memory engine, measured in docs/benchmarks.md); CUDA buffers keep the
        one in-place all-gather."""
        return self.world_size > 1 and not self.broadcast_fp16 and all(b.device.type == "cpu" for b in self.buckets)

    @torch.no_grad()
    def _receive_early(self) -> Optional[List[Any]]:
        """Issue, before this rank's optimizer step, the broadcasts of the blocks of the ranks
        that come before it in the exchange order (ranks N-1 .. rank+1): they write only
        parameters this rank does not step, and travel while it steps, as soon as their owners
        are done. A rank whose step is slow (rank 0 when it owns the largest parameter, as
        FairScale's greedy partition makes it for a tied embedding) then has only its own block
        to send once it is done. Not with a closure (it may read every parameter meanwhile)."""
        if not self._ordered_exchange():
            return None
        return self._broadcast_blocks(range(self.world_size - 1, self.rank, -1))

    def _broadcast_blocks(self, ranks: Any) -> List[Any]:
        """One asynchronous broadcast per rank in ``ranks`` (in that order) and bucket, of that
        rank's block of the bucket from its owner."""
        return [
            self.comm.broadcast(b.block(b.flat, r), root=r, async_op=True)
            for r in ranks
            for b in self.buckets
            if b.lengths[r]
        ]

    @torch.no_grad()
    def _broadcast_params(self, early: Optional[List[Any]] = None) -> None:
        if self._ordered_exchange() and early is None:
            early = self._receive_early()  # a step with a closure: the same order, after the step
        if early is not None:
            for w in early + self._broadcast_blocks(range(self.rank, -1, -1)):
                w.wait()
            return
        works = []
        wires = []
        for b in self.buckets:
            wire = b.flat
            if self.broadcast_fp16 and b.dtype == torch.float32:
                if b.half is None:  # kept between steps: a fresh one costs its page faults every step
                    b.half = torch.empty(b.flat.numel(), dtype=torch.float16, device=b.device)
                wire = b.half
                b.block(wire, self.rank).copy_(b.block(b.flat, self.rank))
            wires.append(wire)
            if self.world_size == 1:
                continue
            if b.stride is not None:
                own = wire[self.rank * b.stride : (self.rank + 1) * b.stride]
                works.append(self.comm.all_gather(wire, own, async_op=True))
            else:
                for r in range(self.world_size):
                    if b.lengths[r]:
                        works.append(self.comm.broadcast(b.block(wire, r), root=r, async_op=True))
        for w in works:
            w.wait()
        for b, wire in zip(self.buckets, wires):
            if wire is not b.flat:
                b.flat.copy_(wire)

    # ------------------------------------------------------------------ gradient norm

    @torch.no_grad()
    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        filter_params_fn: Optional[Callable[[Any], Any]] = None,
    ) -> torch.Tensor:
        """Clip every rank's gradients by the norm of all gradients (over the ranks of the OSS
        group, each rank counting the parameters it owns). Collective. Returns the total norm.
        torch's ``torch.nn.utils.clip_grad_norm_`` does not apply here: each rank would clip by
        the norm of its own gradients only."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        params = self._local_params
        if filter_params_fn is not None:
            if not callable(filter_params_fn):
                raise TypeError(
                    "OSS.clip_grad_norm: argument 'filter_params_fn' must be None or a callable, "
                    f"got {type(filter_params_fn).__name__}"
                )
            params = list(filter_params_fn(params))
        grads = [p.grad.detach() for p in params if p.grad is not None]
        total = reduce_norm_term(self.comm, grad_norm_term(grads, norm_type, device=self._default_device), norm_type)
        total = total.to(norm_dtype(grads))
        clip_coef = max_norm / (total + 1e-6)
        if clip_coef < 1:
            for lists in self.per_device_params.values():
                own = [p.grad.detach() for p in lists[self.rank] if p.grad is not None]
                if own:
                    torch._foreach_mul_(own, clip_coef.to(own[0].device))
        return total

    # ------------------------------------------------------------------ state dicts

    def _shard_state(self) -> Dict[int, Any]:
        """This rank's optimizer state keyed by global parameter index."""
        index = self._param_to_index
        return {index[id(p)]: s for p, s in self.optim.state.items() if s}

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the optimizer state of every rank on ``recipient_rank`` (-1: on every rank), for
        :meth:`state_dict`. Collective. One rank's shard is in flight at a time, as one flat buffer
        (plus its pickled layout); the recipient keeps only the merged state, on CPU."""
        try:
            recipient_rank = operator.index(recipient_rank)  # numpy ints and 0-d int tensors too
        except TypeError:
            raise TypeError(
                "OSS.consolidate_state_dict: argument 'recipient_rank' must be an int, "
                f"got {type(recipient_rank).__name__}"
            ) from None
        if not (recipient_rank == -1 or 0 <= recipient_rank < self.world_size):
            raise ValueError(
                f"OSS.consolidate_state_dict: recipient_rank={recipient_rank} is not a rank of the group "
                f"(expected -1 or 0..{self.world_size - 1})"
            )
        OSS._sync_param_groups(self.param_groups, self.optim.param_groups)
        self._consolidated = None
        collect = recipient_rank in (-1, self.rank)
        merged: Dict[int, Any] = {}
        if collect:
            merged.update(to_cpu(self._shard_state()))
        device = self._default_device
        for src in range(self.world_size):
            if src == recipient_rank:
                continue
            if recipient_rank == -1:
                self._broadcast_shard(src, device, merged)
            elif self.rank == src:
                data, n = pack(self._shard_state(), device)
                self.comm.send(n, recipient_rank)
                if int(n.sum()):
                    self.comm.send(data, recipient_rank)
                del data
            elif self.rank == recipient_rank:
                n = torch.zeros(2, dtype=torch.int64, device=device)
                self.comm.recv(n, src)
                if int(n.sum()):
                    data = torch.empty(int(n.sum()), dtype=torch.uint8, device=device)
                    self.comm.recv(data, src)
                    merged.update(unpack(data, int(n[0])))
                    del data
        if collect:
            self._consolidated = dict(sorted(merged.items()))

    def _broadcast_shard(self, src: int, device: torch.device, merged: Dict[int, Any]) -> None:
        if self.rank == src:
            data, n = pack(self._shard_state(), device)
        else:
            data, n = None, torch.zeros(2, dtype=torch.int64, device=device)
        self.comm.broadcast(n, root=src)
        total = int(n.sum())
        if not total:
            return
        if data is None:
            data = torch.empty(total, dtype=torch.uint8, device=device)
        self.comm.broadcast(data, root=src)
        if self.rank != src:
            merged.update(unpack(data, int(n[0])))

    def state_dict(self, all_ranks: bool = False) -> Dict[str, Any]:
        """The whole optimizer state in PyTorch's format (``state`` keyed by global parameter index,
        ``param_groups`` with every option), as of the last :meth:`consolidate_state_dict`.
        ``all_ranks=True`` consolidates on every rank first (collective)."""
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        if self._consolidated is None:
            raise RuntimeError(
                "OSS.state_dict: the optimizer state has not been consolidated on this rank; call "
                "consolidate_state_dict() on every rank first (or state_dict(all_ranks=True) on every rank)"
            )
        OSS._sync_param_groups(self.param_groups, self.optim.param_groups)
        sd = super().state_dict()
        sd.update(self._inner_extras())
        sd["state"] = dict(self._consolidated)
        return sd

    def local_state_dict(self) -> Dict[str, Any]:
        """This rank's shard, without communication: PyTorch's format with ``state`` holding only
        the entries this rank owns (keyed by global parameter index), plus ``rank`` and
        ``world_size``. Every rank's shard together load at any world size: pass the list of them to
        :meth:`load_state_dict`."""
        OSS._sync_param_groups(self.param_groups, self.optim.param_groups)
        sd = super().state_dict()
        sd.update(self._inner_extras())
        sd["state"] = dict(sorted(self._shard_state().items()))
        sd["rank"], sd["world_size"] = self.rank, self.world_size
        return sd

    def _inner_extras(self, saved: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The inner optimizer's state-dict entries besides ``state`` and ``param_groups`` that hold
        one plain value (fairscale_c.optim.Adam's ``optim_scale``), those in `saved` taking their
        place. Entries per parameter (Adam's master weights) are this rank's partition's and are
        left out: the inner optimizer rebuilds them from the parameters when loading."""
        extras = {
            k: v
            for k, v in self.optim.state_dict().items()
            if k not in ("state", "param_groups") and isinstance(v, (bool, int, float, str, type(None)))
        }
        for k in extras:
            if saved is not None and k in saved:
                extras[k] = saved[k]
        return extras

    def load_state_dict(self, state_dict: Any) -> None:
        """Load a state dict from :meth:`state_dict` (or from the unsharded optimizer), or the list
        of every rank's :meth:`local_state_dict`, saved at any world size: options go to every
        group, and each rank keeps the state of the parameters it owns. ValueError when its
        parameter groups do not match this optimizer's, or the shards are not one complete set."""
        if isinstance(state_dict, (list, tuple)):
            state_dict = merge_shards(state_dict)
        elif isinstance(state_dict, dict) and state_dict.get("world_size", 1) != 1 and "rank" in state_dict:
            n = state_dict["world_size"]
            raise ValueError(
                f"OSS.load_state_dict: argument 'state_dict' is the shard of rank {state_dict['rank']} of {n} "
                f"(local_state_dict()); pass the list of all {n} shards"
            )
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if saved_groups is None or "state" not in state_dict:
            raise ValueError("OSS.load_state_dict: argument 'state_dict' must have 'state' and 'param_groups'")
        mine = [len(g["params"]) for g in self.param_groups]
        theirs = [len(g["params"]) for g in saved_groups]
        if mine != theirs:
            raise ValueError(
                "OSS.load_state_dict: the state dict was saved for a different set of parameters: its param groups "
                f"hold {theirs} parameters, this optimizer's {mine} (a single rank's shard, OSS.optim.state_dict(), "
                "does not load here: save OSS.state_dict() after consolidate_state_dict())"
            )
        params = list(chain(*(g["params"] for g in self.param_groups)))
        owner = self.param_to_rank
        key_to_param = dict(zip(chain(*(g["params"] for g in saved_groups)), params))
        for key, value in state_dict["state"].items():
            p = key_to_param.get(key)
            if p is None:
                raise ValueError(f"OSS.load_state_dict: state key {key!r} names no parameter of its param_groups")
            for name, v in value.items() if isinstance(value, dict) else ():
                if name in PER_ELEMENT_STATE and torch.is_tensor(v) and v.shape != p.shape:
                    raise ValueError(
                        f"OSS.load_state_dict: state '{name}' of parameter {key} has shape {tuple(v.shape)}, but "
                        f"that parameter has shape {tuple(p.shape)} (a state dict of another model?)"
                    )
        local_index = {id(p): i for i, p in enumerate(chain(*(g["params"] for g in self.optim.param_groups)))}
        local_state = {}
        for key, value in state_dict["state"].items():
            p = key_to_param[key]
            if owner[p] == self.rank:
                local_state[local_index[id(p)]] = copy_state(value)
        local_groups = []
        for saved, g in zip(saved_groups, self.optim.param_groups):
            local = {k: v for k, v in saved.items() if k != "params"}
            local["params"] = [local_index[id(p)] for p in g["params"]]
            local_groups.append(local)
        self.optim.load_state_dict(
            {**self._inner_extras(state_dict), "state": local_state, "param_groups": local_groups}
        )
        OSS._sync_param_groups(saved_groups, self.param_groups)
        OSS._sync_param_groups(self.param_groups, self.optim.param_groups)
