"""ShardedDataParallel: data parallelism whose gradients reduce only to the rank that owns them
(ZeRO-2 with :class:`fairscale_c.optim.OSS`), FairScale 0.4.13's API.

During backward each trainable parameter's gradient is copied, as soon as autograd has accumulated
it, into the flat buffer of its bucket (parameters of one owner rank, device and dtype, up to
``reduce_buffer_size`` elements; allocated once, reused by every backward) and dropped; a full
bucket is averaged onto its owner with one asynchronous ``reduce`` through
``fairscale_c.distributed``, so the reduction overlaps the rest of backward. A gradient of
``_DIRECT_MIN`` (2**20) elements or more skips the copy: it is averaged in place, in autograd's
own tensor, by an operation of its own. Buckets are launched in a fixed order
on every rank. At the end of backward every reduction is waited for: the owner's ``p.grad`` is a
view of the reduced bucket (or the reduced tensor itself), every other rank's is None; the
next backward overwrites the bucket (a gradient still accumulating is copied out first). The
optimizer then steps (OSS broadcasts the updated parameters).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Generator, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from fairscale_c import distributed as fdist
from fairscale_c.optim.oss import OSS
from ...internal.args import as_int, refuse_meta_tensors, refuse_sparse_gradients
from ...internal.hooks import weak_hook

__all__ = ["ShardedDataParallel"]

_log = logging.getLogger(__name__)


# A gradient of at least this many elements is reduced in place, in its own operation, instead
# of being copied into a bucket first: at this size the copy costs more than the operation's fixed
# overhead saves.
_DIRECT_MIN = 1 << 20

# The smallest packed bucket (bytes) given a shared buffer: the CPU engine reduces onto shared
# tensors from 1 MiB (csrc/comm/shm_direct.c, FSC_SHM_SHARED_MIN) and smaller ones on its slots.
_SHARED_MIN_BYTES = 1 << 20


@dataclass
class _Bucket:
    """Gradients of ``params`` (one owner, device and dtype) reduced together; ``offsets[i]`` is
    where params[i] sits in ``flat``. Per-backward state: ``flat``, ``pending``, ``work``.
    ``buffer``: the bucket's flat buffer, kept across backward passes (``flat`` is it, or
    autograd's own gradient for a bucket reduced in place); on CPU allocated with the buckets, in a
    shared tensor, elsewhere at its first use."""

    owner: int
    device: torch.device
    dtype: torch.dtype
    wire_dtype: torch.dtype
    params: List[nn.Parameter]
    offsets: List[int]
    numel: int
    flat: Optional[torch.Tensor] = None
    buffer: Optional[torch.Tensor] = None
    pending: int = 0
    work: Any = None
    checked_in: List[bool] = field(default_factory=list)

    def reset(self) -> None:
        self.flat, self.work = None, None
        self.pending = len(self.params)
        self.checked_in = [False] * len(self.params)


class ShardedDataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training with the sharded optimizer(s) that own its
    parameters::

        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        model = ShardedDataParallel(model, opt)
        loss = model(x).sum(); loss.backward(); opt.step()

    ``sharded_optimizer``: an :class:`~fairscale_c.optim.OSS` or a list of them (anything else is a
    TypeError). ``process_group``: as OSS's ``group`` (default: the world); it must have OSS's
    ranks. ``broadcast_buffers``: buffers come from rank 0 before every forward (outside
    ``no_sync``). ``sync_models_at_startup``: rank 0's parameters and buffers are sent to all ranks
    now. ``reduce_buffer_size``: elements per gradient bucket (0: one reduction per parameter).
    ``reduce_fp16``: float32 gradients travel as float16 (with or without buckets; FairScale
    ignores it with buckets). ``auto_refresh_trainable``: a change of ``requires_grad`` is picked up
    at the next forward (else call :meth:`refresh_trainable`).
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: Union[OSS, List[OSS]],
        process_group: Any = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = 2**23,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"ShardedDataParallel: argument 'module' must be a torch.nn.Module, got {type(module).__name__}"
            )
        optims = list(sharded_optimizer) if isinstance(sharded_optimizer, (list, tuple)) else [sharded_optimizer]
        bad = [type(o).__name__ for o in optims if not isinstance(o, OSS)]
        if bad or not optims:
            raise TypeError(
                "ShardedDataParallel: argument 'sharded_optimizer' must be a fairscale_c.optim.OSS (or a list of "
                f"them), got {', '.join(bad) or 'an empty list'}; wrap it: OSS(params, optim=<its class>, ...)"
            )
        if as_int(reduce_buffer_size) is None or reduce_buffer_size < 0:
            raise ValueError(
                "ShardedDataParallel: argument 'reduce_buffer_size' must be an int >= 0 (elements), "
                f"got {reduce_buffer_size!r}"
            )
        reduce_buffer_size = as_int(reduce_buffer_size)
        self.module = module
        self._sharded_optimizers = optims
        self._enable_broadcast_buffers = bool(broadcast_buffers)
        self._auto_refresh_trainable = bool(auto_refresh_trainable)
        self._reduce_fp16 = bool(reduce_fp16)
        self._warn_on_trainable_params_changed = bool(warn_on_trainable_params_changed)
        self._process_group = process_group
        if process_group is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            fdist.require_initialised_world("ShardedDataParallel(process_group=None)")
        self.comm = fdist.group_for(process_group, argument="ShardedDataParallel: argument 'process_group'")
        self._rank, self._world_size = self.comm.rank, self.comm.size
        for o in optims:
            if o.world_size != self._world_size or o.rank != self._rank:
                raise ValueError(
                    f"ShardedDataParallel: the OSS optimizer's group (rank {o.rank} of {o.world_size}) and argument "
                    f"'process_group' (rank {self._rank} of {self._world_size}) must be the same ranks"
                )
        refuse_sparse_gradients(module, "ShardedDataParallel")
        refuse_meta_tensors(module, "ShardedDataParallel")
        device_types = {p.device.type for p in module.parameters()}
        if len(device_types) > 1:
            raise ValueError(
                f"ShardedDataParallel: the module's parameters must be on one device type, found {sorted(device_types)}"
            )
        self.device_type = device_types.pop() if device_types else "cpu"
        self.is_multi_device_module = len({p.device for p in module.parameters()}) > 1
        self._all_params: List[nn.Parameter] = self._optimized_params()
        self._known_count = self._param_count()
        known = {id(p) for p in self._all_params}
        missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in known]
        if missing:
            _log.warning(
                "ShardedDataParallel: parameters %s are in no sharded optimizer; their gradients are not reduced",
                missing,
            )
        self._buffer_max_size = 0 if self._world_size == 1 else reduce_buffer_size
        self._reference_trainable_mask = [p.requires_grad for p in self._all_params]
        self._trainable_params: List[nn.Parameter] = []
        self._trainable_param_to_rank: Dict[nn.Parameter, int] = {}
        self._buckets: List[_Bucket] = []
        self._where: Dict[nn.Parameter, tuple] = {}  # param -> (bucket index, position)
        self._grad_hooks: List[Any] = []
        self._should_accumulate_grads = False
        self._armed = False  # a training forward ran: the next backward reduces
        self._to_drop: List[tuple] = []  # (param, grad) checked in; dropped once the param's later hooks ran
        self._callback_queued = False
        self._next_launch = 0
        self._pending = 0  # gradients of this backward not yet checked in
        self._overlapped = 0  # buckets of the last backward sent while gradients were still to come
        self._buffer_works: List[Any] = []
        # owner gradients set by the last reduction, held weakly: zero_grad(set_to_none=True) frees them
        self._reduced: Dict[nn.Parameter, Any] = {}
        self._saved: Dict[nn.Parameter, torch.Tensor] = {}  # ... set aside while the next is accumulated
        self._zeroed: Dict[nn.Parameter, int] = {}  # ... zeroed by zero_grad: its version counter then
        if sync_models_at_startup:
            self._sync_params_and_buffers()

    # ------------------------------------------------------------------ module plumbing

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        needs_setup = not self._buckets and self.training
        if self._auto_refresh_trainable:
            needs_setup |= self._detect_train_change()
            needs_setup |= self._param_count() != self._known_count  # a param group was added
        if needs_setup:
            self.refresh_trainable()
        if self._enable_broadcast_buffers and not self._should_accumulate_grads:
            self.sync_buffers(blocking=True)
        self._wait_buffer_works()
        if self.training and torch.is_grad_enabled():
            self._arm()
        return self.module(*inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Attributes missing here come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def __copy__(self) -> "ShardedDataParallel":
        """A shallow copy shares everything (the module, the optimizers, the group), as Python's default."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError(
            "ShardedDataParallel cannot be pickled or deep-copied: it is bound to a live process group and "
            "its optimizers. Copy or save the wrapped module instead (copy.deepcopy(model.module), "
            "model.module.state_dict())"
        )

    def to(
        self, device: Any = None, dtype: Optional[torch.dtype] = None, non_blocking: bool = False
    ) -> "ShardedDataParallel":  # type: ignore[override]
        """Cast (and move within the device type) the module; the sharded optimizers' buffers follow.
        A change of device type is a ValueError: the optimizers' state would be left behind."""
        if isinstance(device, torch.dtype) and dtype is None:  # to(torch.float64), as nn.Module takes it
            device, dtype = None, device
        if isinstance(device, str):
            device = torch.device(device)
        if device is not None and device.type != self.device_type:
            raise ValueError(
                f"ShardedDataParallel.to: argument 'device' ({device}) changes the device type from "
                f"'{self.device_type}'; build the model on its device before wrapping it (the optimizer state "
                "would be left behind)"
            )
        if device is not None and self.is_multi_device_module:
            raise ValueError("ShardedDataParallel.to: the module spans several devices; it cannot be moved to one")
        self.module.to(device=device, dtype=dtype, non_blocking=non_blocking)
        self.refresh_trainable()
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> "ShardedDataParallel":
        """``half()``, ``double()``, ``float()`` and the like: when they change a parameter's dtype or
        device, the buckets and the optimizers' buffers follow (as in :meth:`to`; every rank then
        calls it). A call that changes nothing (``cpu()`` on a CPU model) stays local."""
        before = [(p.dtype, p.device) for p in self._all_params]
        super()._apply(fn, recurse)
        if self._buckets and [(p.dtype, p.device) for p in self._all_params] != before:
            self.refresh_trainable()
        return self

    # ------------------------------------------------------------------ trainability

    def _optimized_params(self) -> List[nn.Parameter]:
        return [
            p
            for o in self._sharded_optimizers
            for lists in o.per_device_params.values()
            for params in lists
            for p in params
        ]

    def _param_count(self) -> int:
        return sum(len(g["params"]) for o in self._sharded_optimizers for g in o.param_groups)

    def _detect_train_change(self) -> bool:
        mask = [p.requires_grad for p in self._all_params]
        changed = mask != self._reference_trainable_mask
        if changed:
            if self._warn_on_trainable_params_changed:
                _log.warning("ShardedDataParallel: the trainable parameters changed; refreshing the reduction plan")
            self._reference_trainable_mask = mask
        return changed

    @torch.inference_mode(False)  # what it builds serves training, even when a forward under
    def refresh_trainable(self) -> None:  # torch.inference_mode() calls it
        """Rebuild buckets and hooks (and the optimizers' buffers) for the current ``requires_grad``
        flags. Every rank calls it."""
        if self._armed and any(b.pending < len(b.params) for b in self._buckets):
            _log.warning(
                "ShardedDataParallel.refresh_trainable: gradients were waiting to be reduced "
                "(use no_sync() to accumulate)"
            )
        self._all_params = self._optimized_params()
        self._known_count = self._param_count()
        self._trainable_params = [p for p in self._all_params if p.requires_grad]
        self._trainable_param_to_rank = {}
        for o in self._sharded_optimizers:
            o.refresh_trainable()
            owner = o.param_to_rank
            for p in self._trainable_params:
                if p in owner:
                    self._trainable_param_to_rank[p] = owner[p]
        self._reference_trainable_mask = [p.requires_grad for p in self._all_params]
        self._setup_buckets()
        self._setup_backward_hooks()

    def _setup_buckets(self) -> None:
        """Buckets in the order gradients usually arrive (reverse registration order), per
        (owner, device, dtype), each at most ``reduce_buffer_size`` elements (a larger parameter
        gets a bucket of its own)."""
        module_order = {id(p): i for i, p in enumerate(self.module.parameters())}
        order = sorted(self._trainable_params, key=lambda p: -module_order.get(id(p), -1))
        open_buckets: Dict[tuple, _Bucket] = {}
        buckets: List[_Bucket] = []
        packed: List[_Bucket] = []  # those that gradients are copied into
        for p in order:
            owner = self._trainable_param_to_rank[p]
            key = (owner, p.device, p.dtype)
            wire = torch.float16 if self._reduce_fp16 and p.dtype == torch.float32 else p.dtype
            if p.numel() >= _DIRECT_MIN and wire == p.dtype:  # reduced in place, no bucket copy
                buckets.append(_Bucket(owner, p.device, p.dtype, wire, [p], [0], p.numel()))
                continue
            b = open_buckets.get(key)
            if b is None or b.numel + p.numel() > max(self._buffer_max_size, 1):
                b = _Bucket(owner, p.device, p.dtype, wire, [], [], 0)
                buckets.append(b)
                packed.append(b)
                open_buckets[key] = b
            b.params.append(p)
            b.offsets.append(b.numel)
            b.numel += p.numel()
        # A bucket is complete when its last parameter's gradient comes: launch them in that order.
        position = {id(p): i for i, p in enumerate(order)}
        buckets.sort(key=lambda b: position[id(b.params[-1])])
        self._buckets = buckets
        self._where = {p: (i, j) for i, b in enumerate(buckets) for j, p in enumerate(b.params)}
        if self.device_type == "cpu" and self._world_size > 1:
            # Packed buckets' buffers now, on every rank alike, in shared tensors: a bucket's reduce
            # then has every rank reduce its part straight into the owner's buffer. Smaller ones
            # stay ordinary (allocated at first use): the engine reduces them on its slots anyway.
            for b in packed:
                if b.numel * b.wire_dtype.itemsize >= _SHARED_MIN_BYTES:
                    b.buffer = fdist.shared_zeros(b.numel, dtype=b.wire_dtype, device=b.device, group=self.comm)
        for b in buckets:
            b.reset()
        self._next_launch = 0

    def _setup_backward_hooks(self) -> None:
        while self._grad_hooks:
            self._grad_hooks.pop().remove()
        if self.training and any(p.grad is not None and p.grad.requires_grad for p in self._trainable_params):
            raise RuntimeError("ShardedDataParallel only works with gradients that do not require grad")
        if self._world_size == 1:
            return  # nothing to reduce: gradients stay where autograd puts them
        for p in self._trainable_params:
            self._grad_hooks.append(p.register_hook(weak_hook(self._before_accumulate, p)))
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready)))

    # ------------------------------------------------------------------ gradient path

    def _arm(self) -> None:
        """A training forward: the next backward reduces every trainable gradient once."""
        for b in self._buckets:
            b.reset()
        self._pending = sum(len(b.params) for b in self._buckets)
        self._overlapped = 0
        self._next_launch = 0
        self._armed = True
        self._callback_queued = False

    def _before_accumulate(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """A new gradient is about to be added to ``p.grad``: if that still holds what the last
        reduction gave this owner (accumulation without no_sync), set it aside and add it back
        after the next reduction, so that it is not averaged over the ranks a second time. One
        that zero_grad zeroed and nothing wrote since is dropped instead (there is nothing to add);
        one living in a bucket's buffer is copied out first (the buffer is about to be reused)."""
        if grad.is_sparse:
            raise RuntimeError(
                f"ShardedDataParallel: a parameter of shape {tuple(p.shape)} got a sparse gradient; sparse gradients "
                "are not reduced (build nn.Embedding / nn.EmbeddingBag with sparse=False)"
            )
        if not self._armed:
            return  # no reduction comes: the gradient adds to p.grad as autograd does
        self._set_aside_reduced(p)

    def _set_aside_reduced(self, p: nn.Parameter) -> None:
        """If ``p.grad`` is what the last reduction gave this owner, take it out of ``p.grad``:
        into ``_saved`` (added back after the next reduction), or dropped if zero_grad zeroed it
        and nothing wrote since; one living in a bucket's buffer is copied (the buffer is about to
        be reused)."""
        ref = self._reduced.pop(p, None)
        g = ref() if ref is not None else None
        zeroed = self._zeroed.pop(p, None)
        if g is not None and p.grad is g:
            p.grad = None
            if zeroed is not None and zeroed == g._version:
                return
            where = self._where.get(p)
            buf = self._buckets[where[0]].buffer if where is not None else None
            in_buffer = buf is not None and g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            self._saved[p] = g.clone() if in_buffer else g

    def _take_local_grad(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        """This rank's contribution for ``p`` when its gradient hook did not run in this backward
        (unused by it here), taken out of ``p.grad``: what backward passes under no_sync() left
        there, or None where there is nothing (what the last reduction gave is set aside instead)."""
        self._set_aside_reduced(p)
        g, p.grad = p.grad, None
        return g

    @torch.no_grad()
    def _grad_ready(self, p: nn.Parameter) -> None:
        self._drop_checked_in()
        if self._should_accumulate_grads:
            return
        if not self._armed:
            return
        where = self._where.get(p)
        if where is None:
            return
        i, j = where
        b = self._buckets[i]
        if b.checked_in[j]:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._check_in(b, j, p.grad)
        self._to_drop.append((p, p.grad))  # hooks registered after this one still see the local gradient
        self._launch_ready()

    def _drop_checked_in(self) -> None:
        """Drop the local gradients already copied into their buckets (or being reduced in place)."""
        for p, g in self._to_drop:
            if p.grad is g:
                p.grad = None
        self._to_drop.clear()

    def _check_in(self, b: _Bucket, j: int, grad: Optional[torch.Tensor]) -> None:
        if (
            len(b.params) == 1
            and grad is not None
            and grad.dtype == b.wire_dtype
            and grad.is_contiguous()
            and b.numel >= _DIRECT_MIN
        ):
            b.flat = grad.view(-1)  # autograd's own gradient tensor, averaged in place
        elif b.flat is None:
            if b.buffer is None:  # kept across backward passes: a fresh one costs its page faults every time
                b.buffer = torch.empty(b.numel, dtype=b.wire_dtype, device=b.device)
            b.flat = b.buffer
        view = b.flat[b.offsets[j] : b.offsets[j] + b.params[j].numel()]
        if grad is None:
            view.zero_()  # no gradient here (unused on this rank): contributes zeros
        else:
            view.copy_(grad.reshape(-1))
        b.checked_in[j] = True
        b.pending -= 1
        self._pending -= 1

    def _launch_ready(self) -> None:
        """Start the reductions of the complete buckets, in bucket order (the same on every rank)."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            b = self._buckets[self._next_launch]
            b.work = self.comm.reduce(b.flat, root=b.owner, op="avg", async_op=True)
            self._next_launch += 1
            self._overlapped += self._pending > 0

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End of backward: send what is left (for a parameter this backward did not reach, what
        no_sync() backward passes left in its gradient, else zeros), wait for every
        reduction, hand owners their gradients."""
        self._callback_queued = False
        self._flush()

    def _flush(self) -> None:
        self._drop_checked_in()
        for b in self._buckets[self._next_launch :]:
            for j, done in enumerate(b.checked_in):
                if not done:  # unused by this rank in this backward
                    self._check_in(b, j, self._take_local_grad(b.params[j]))
        self._launch_ready()
        try:
            for b in self._buckets:
                if b.work is not None:
                    b.work.wait()
        finally:
            self._armed = False
        for b in self._buckets:
            if b.owner == self._rank and b.flat is not None:
                flat = b.flat if b.wire_dtype == b.dtype else b.flat.to(b.dtype)
                for p, off in zip(b.params, b.offsets):
                    g = _own_version(flat, off, p)
                    saved = self._saved.pop(p, None)
                    if saved is not None:
                        g = g.add_(saved)
                    p.grad = g
                    self._reduced[p] = weakref.ref(g)
            b.flat, b.work = None, None

    def reduce(self) -> None:
        """Reduce the gradients now (normally automatic in backward); e.g. after backward passes
        under no_sync(). Every rank calls it. In a group of one nothing is reduced: the
        gradients stay where autograd put them."""
        if self._world_size == 1:
            return
        if not any(not all(b.checked_in) for b in self._buckets) or not self._buckets:
            raise RuntimeError(
                "ShardedDataParallel.reduce: no gradients are waiting to be reduced (called twice, or no backward "
                "since the last forward?)"
            )
        with torch.no_grad():
            for b in self._buckets:
                for j, p in enumerate(b.params):
                    if not b.checked_in[j]:
                        self._check_in(b, j, self._take_local_grad(p))
            self._flush()

    # ------------------------------------------------------------------ gradient accumulation, zero_grad

    @contextlib.contextmanager
    def no_sync(self) -> Generator:
        """Backward passes inside accumulate local gradients without communication; the first
        backward outside reduces the accumulated sum."""
        old = self._should_accumulate_grads
        self._should_accumulate_grads = True
        try:
            yield
        finally:
            self._should_accumulate_grads = old

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero (or drop, with ``set_to_none``) the gradients of the trainable parameters."""
        self._saved.clear()
        self._zeroed.clear()
        for p in self._trainable_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()
                ref = self._reduced.get(p)
                if ref is not None and ref() is p.grad:
                    self._zeroed[p] = p.grad._version

    # ------------------------------------------------------------------ buffers and start-up sync

    @torch.no_grad()
    def sync_buffers(self, blocking: bool = False) -> None:
        """Send rank 0's buffers (e.g. batch-norm statistics) to every rank. Collective. Without
        ``blocking`` the broadcasts complete before the next forward."""
        if self._world_size == 1:
            return
        for buf in self.module.buffers(recurse=True):
            self._buffer_works.append(self._broadcast_from_rank0(buf))
        if blocking:
            self._wait_buffer_works()

    def _wait_buffer_works(self) -> None:
        works, self._buffer_works = self._buffer_works, []
        for w in works:
            w.wait()

    def _broadcast_from_rank0(self, t: torch.Tensor) -> "_Broadcast":
        """Start broadcasting rank 0's ``t`` into every rank's ``t``: in place when ``t`` is
        contiguous, else through a contiguous copy that wait() copies back."""
        wire = t if t.is_contiguous() else t.contiguous()
        sent = wire.view(torch.uint8) if wire.dtype == torch.bool else wire
        work = self.comm.broadcast(sent, root=0, async_op=True)
        return _Broadcast(work, None if wire is t or self._rank == 0 else (t, wire))

    @torch.no_grad()
    def _sync_params_and_buffers(self) -> None:
        if self._world_size == 1:
            return
        works = [self._broadcast_from_rank0(t) for t in _unique(self.module.state_dict().values())]
        for w in works:
            w.wait()


def _unique(tensors: Any) -> List[torch.Tensor]:
    """Non-empty tensors, each memory region once (tied weights appear once)."""
    seen, out = set(), []
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype) if torch.is_tensor(t) else None
        if key is not None and t.numel() and key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _own_version(flat: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """``flat[offset : offset + p.numel()]`` shaped as ``p``, as a tensor of its own rather than a
    view: it shares the memory but not the version counter, so writes into the rest of ``flat``
    do not count as writes to it (zero_grad's "zeroed and not written since" test relies on it)."""
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
        flat.untyped_storage(), flat.storage_offset() + offset, p.shape
    )


class _Broadcast(NamedTuple):
    """A broadcast of module state in flight; ``copy_back`` is (the state, the contiguous copy
    that travels in its place) when the state is not contiguous."""

    work: Any
    copy_back: Optional[Tuple[torch.Tensor, torch.Tensor]]

    def wait(self) -> None:
        self.work.wait()
        if self.copy_back is not None:
            dst, src = self.copy_back
            with torch.no_grad():
                dst.copy_(src)
