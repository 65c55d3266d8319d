"""FullyShardedDataParallel with FairScale 0.4.13's API; the bytes move through fairscale_c's C core.

Per instance, the parameters it owns (not those of nested instances) are laid out in one flat
buffer per requires_grad value (one buffer when all agree, as in FairScale), sharded across the
process group. Forward: cast the fp32 shard to the compute dtype into this rank's block of the
full buffer and all-gather in place (C), point the module's parameters at views of it, run, free
the full buffer's storage; from the second iteration the next instance's all-gather is started
while the current one computes. Backward: re-gather (prefetching the previous instance); when the
full buffer's gradient is complete, reduce-scatter it asynchronously (C engine, overlapping the
rest of backward; small gradients are packed into bucket_cap_mb buckets first); finished
reduce-scatters, and the oldest beyond two in flight, are retired during backward (their full
gradient released); at the end of backward the root retires the rest, casts to fp32 and sets
``flat_param.grad`` to the averaged shard.
"""

import contextlib
import threading
from collections.abc import Mapping
from typing import Any, Dict, Generator, Iterator, List, Optional, Tuple

import torch
from torch import nn

from fairscale_c import _C
from fairscale_c.internal.parallel import ProcessGroupName
from fairscale_c.internal.params import grad_norm_term, norm_dtype, reduce_norm_term

from . import _optim_state, _state_dict
from ._state_dict import no_pre_load_state_dict_hook  # noqa: F401 - FairScale defines it in this module
from ._args import check_fsdp_args
from ._bucket import ReduceScatterBucket
from ._backward import BackwardHooks, _graph_task, outer_graph_uses_full, sequence_mark
from ._full_params import FullParams
from ._setup import Setup, is_managed
from ._handle import TrainingState, free_storage
from ._tensors import cast_floats


class FullyShardedDataParallel(Setup, FullParams, BackwardHooks, nn.Module):
    """A drop-in for ``fairscale.nn.FullyShardedDataParallel`` (0.4.13): same arguments, same
    defaults, same state-dict formats. See docs/fsdp.md for what differs."""

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[Any] = None,
        process_group_reduce_scatter: Any = ProcessGroupName.reduce_scatter,
        reshard_after_forward: bool = True,
        disable_reshard_on_root: bool = True,
        mixed_precision: bool = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        move_grads_to_cpu: Optional[bool] = None,
        bucket_cap_mb: int = 25,
        compute_device: Optional[torch.device] = None,
        no_broadcast_optim_state: Optional[bool] = False,
        state_dict_device: Optional[torch.device] = None,
        clear_autocast_cache: bool = False,
        force_input_to_fp32: bool = False,
        verbose: bool = False,
        cpu_offload: bool = False,
        state_dict_on_rank_0_only: bool = False,
        gradient_predivide_factor: Optional[float] = None,
        allow_reset_parameters: bool = False,
    ):
        check_fsdp_args(locals())
        super().__init__()
        self.compute_device = _compute_device_of(module, compute_device)
        self._init_groups(process_group, process_group_reduce_scatter)
        self.reshard_after_forward = reshard_after_forward
        self.disable_reshard_on_root = disable_reshard_on_root
        self.mixed_precision = mixed_precision
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.flatten_parameters = flatten_parameters
        self.move_params_to_cpu = move_params_to_cpu or cpu_offload
        self.compute_dtype = compute_dtype or (torch.float16 if mixed_precision else torch.float32)
        self.buffer_dtype = buffer_dtype or self.compute_dtype
        self.move_grads_to_cpu = self.move_params_to_cpu if move_grads_to_cpu is None else move_grads_to_cpu
        self.bucket_cap_mb = bucket_cap_mb
        self.no_broadcast_optim_state = no_broadcast_optim_state
        self.clear_autocast_cache = clear_autocast_cache
        self.force_input_to_fp32 = force_input_to_fp32
        self.verbose = verbose
        self.state_dict_on_rank_0_only = state_dict_on_rank_0_only
        self.allow_reset_parameters = allow_reset_parameters
        self.gradient_predivide_factor = float(
            gradient_predivide_factor
            if gradient_predivide_factor is not None
            else self._get_gradient_predivide_factor(self.world_size)
        )
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor
        self._init_shards(module, state_dict_device)
        self._init_state()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "FullyShardedDataParallel":
        """FairScale's hook for ``.half()``, ``.float()``, ``.bfloat16()``, ``.to(dtype)`` after
        wrapping: the shards (and buffers) are converted by nn.Module, and without mixed precision
        the compute dtype and the full buffers follow the shards' new dtype (with mixed precision
        the compute dtype stays, as in FairScale). Moving a wrapped module to another device is
        refused before anything changes: move the module before wrapping it."""
        self._settle_failed_backward()
        self.assert_state(TrainingState.IDLE)
        for h in self._handles:
            probe = fn(h.param.detach()[:0])  # what the conversion does, on an empty view
            if probe.device != h.param.device:
                raise RuntimeError(
                    f"FullyShardedDataParallel: cannot move a wrapped module from {h.param.device} to "
                    f"{probe.device}; move the module before wrapping it (FSDP(module.to(device)))"
                )
            if probe.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(
                    f"FullyShardedDataParallel: cannot convert the parameters to {probe.dtype}; "
                    "float32, float16 and bfloat16 are supported"
                )
        before = self._handles[0].param.dtype if self._handles else None
        ret = super()._apply(fn, *args, **kwargs)
        for h in self._handles:  # nn.Module may have swapped the Parameter objects
            owner = self if self.flatten_parameters else h.layout.slots[0].module
            name = h.backing_name if self.flatten_parameters else h.layout.slots[0].attr
            h.param = owner._parameters[name]
            if not self.flatten_parameters:
                for module, attr in h.places():
                    module._parameters[attr] = h.param
        for t in self._ties:
            t.module._parameters[t.attr] = t.handle.param
        if self._handles and not self.mixed_precision and self._handles[0].param.dtype is not before:
            self.compute_dtype = self._handles[0].param.dtype
            with torch.no_grad():
                for h in self._handles:
                    h.full = h.new_full(self.compute_dtype, self.compute_device)
                    self._hook_full(h)
                    free_storage(h.full.detach())
                    h.has_full = False
                self._leave_shaped_views()
        return ret

    @staticmethod
    def _get_gradient_predivide_factor(world_size: int) -> float:
        factor = 1
        while world_size % factor == 0 and world_size / factor > factor:
            factor *= 2
        return float(factor)

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Divide gradients by `pre` before and `post` after the reduction (FairScale's API)."""
        self._settle_failed_backward()
        self.assert_state(TrainingState.IDLE)
        for m in get_fsdp_instances(self) if recursive else [self]:
            m.gradient_predivide_factor, m.gradient_postdivide_factor = pre, post

    # ---------------------------------------------------------------- module plumbing

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def params(self) -> List[nn.Parameter]:
        """This instance's shards, then the parameters it shares with other instances (FairScale's order)."""
        return [h.param for h in self._all_handles]

    def non_shared_params(self) -> List[nn.Parameter]:
        """This instance's own shards (FairScale's name): without those another instance owns."""
        return [h.param for h in self._handles]

    @property
    def _has_shared_params(self) -> bool:
        return bool(self._ties)

    @property
    def has_full_params(self) -> bool:
        """Whether this instance's full parameters are gathered now (FairScale's flag): inside
        forward and backward with ``reshard_after_forward=False``, or in ``summon_full_params``."""
        return bool(self._all_handles) and all(h.has_full or h.summoned is not None for h in self._all_handles)

    @property
    def buffer_size(self) -> int:
        """Elements of the parameters this instance shards (unpadded), as in FairScale."""
        return sum(slot.numel for h in self._handles for slot in h.layout.slots)

    @property
    def num_params_managed(self) -> int:
        """How many of the module's parameters this instance shards (FairScale's
        FlattenParamsWrapper count, reached through its FSDP)."""
        return sum(len(h.layout.slots) for h in self._handles)

    def append_shared_param(self, p: nn.Parameter) -> None:
        """FairScale's call to share `p`, a parameter another instance has already sharded and
        this instance's module also holds (a weight tied across instances). Here such ties are
        found when the instance is built, flattened or not, siblings or nested; this checks that
        `p` is one of them and, as in FairScale, that no forward has run yet."""
        if self._is_root is not None:
            raise RuntimeError("FullyShardedDataParallel.append_shared_param: call it before the first forward")
        if not isinstance(p, nn.Parameter) or not is_managed(p):
            raise ValueError(
                "FullyShardedDataParallel.append_shared_param: argument 'p' must be a parameter sharded by "
                f"another FullyShardedDataParallel instance (e.g. other.module.weight), got {type(p).__name__}"
                + ("" if not isinstance(p, nn.Parameter) else " not sharded by any instance")
            )
        if any(h.param is p for h in self._handles):
            raise ValueError(
                "FullyShardedDataParallel.append_shared_param: argument 'p' is this instance's own parameter; "
                "expected one sharded by another instance"
            )
        if not any(t.handle.param is p for t in self._ties):
            raise ValueError(
                "FullyShardedDataParallel.append_shared_param: argument 'p' is not a parameter of this instance's "
                "module; tie it first (e.g. module.weight = other.weight) and wrap the module afterwards"
            )

    @property
    def params_with_grad(self) -> List[nn.Parameter]:
        return [p for p in self.parameters() if p.grad is not None]

    @property
    def cpu_offload(self) -> bool:
        return self.move_params_to_cpu

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Parameter]]:
        """nn.Module's names while the parameters are flat shards; under summon_full_params, or when
        not flattening, without the wrapper names (``_fsdp_wrapped_module``), so they are the
        unwrapped model's names, as in FairScale. (A parent module's named_parameters() does not
        call this and keeps the wrapper names, as in FairScale.)"""
        self._settle_failed_backward()  # unflattened, its parameters are not registered meanwhile
        clean = not self.flatten_parameters or self.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, p in super().named_parameters(*args, **kwargs):
            yield (_state_dict.clean_path(name) if clean else name), p

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError(
            "FullyShardedDataParallel cannot be pickled or deep-copied: it holds shards bound to a live "
            "process group and its communicators. Save state_dict() or local_state_dict() + "
            "local_metadata_dict() instead, or copy the module before wrapping it."
        )

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, mixed_precision={self.mixed_precision}, "
            f"compute_dtype={self.compute_dtype}, reshard_after_forward={self.reshard_after_forward}, "
            f"flat_params={[h.layout.numel for h in self._handles]}"
        )

    def assert_state(self, state: Any) -> None:
        states = state if isinstance(state, (list, tuple)) else [state]
        if self.training_state not in states:
            raise RuntimeError(
                f"FullyShardedDataParallel: expected to be in state {[s.name for s in states]}, "
                f"but it is in state {self.training_state.name}"
            )

    def reset_parameters(self) -> None:
        if not self.allow_reset_parameters:
            raise RuntimeError(
                "FullyShardedDataParallel.reset_parameters: parameters are sharded; pass "
                "allow_reset_parameters=True to call the wrapped module's reset_parameters"
            )
        self.module.reset_parameters()

    def apply(self, fn):
        """Module.apply with the full parameters in place (under summon_full_params(recurse=False))."""
        self._settle_failed_backward()
        self.assert_state(TrainingState.IDLE)
        with self.summon_full_params(recurse=False):
            return super().apply(fn)

    # ---------------------------------------------------------------- forward

    def _lazy_init(self) -> None:
        if self._is_root is not None:
            return
        self._is_root = True
        self._fsdp_instances = get_fsdp_instances(self)
        # Forward order of the instances, recorded in the first forward; later forwards prefetch
        # the next instance's all-gather while the current one computes (and backward the previous).
        self._bucket = ReduceScatterBucket(self.bucket_cap_mb)  # serves every nested instance
        self._exec_order: List["FullyShardedDataParallel"] = []
        self._order_recorded = False
        for m in self._fsdp_instances:
            object.__setattr__(m, "_root", self)  # not a submodule: plain attribute
            if m is not self:
                if m._is_root:
                    raise RuntimeError("FullyShardedDataParallel: a nested instance ran forward before its root")
                m._is_root = False
        for m in self._fsdp_instances:
            m._check_ties(self._fsdp_instances)
        if self.disable_reshard_on_root:
            self.reshard_after_forward = False
        # Each instance casts the buffers it owns (not those of nested instances) to its own
        # buffer_dtype, as FairScale does: an fp32 BatchNorm instance inside a mixed-precision root
        # keeps fp32 running statistics. The cast may run in a first forward under
        # torch.inference_mode(); the buffers it makes must still serve later training steps.
        with torch.inference_mode(False), torch.no_grad():
            for m in self._fsdp_instances:
                for owner, name, buf in _own_buffers(m):
                    if buf.is_floating_point() and buf.dtype is not m.buffer_dtype:
                        owner._buffers[name] = buf.to(m.buffer_dtype)

    def _check_ties(self, instances: List["FullyShardedDataParallel"]) -> None:
        """A shared parameter's owner must be under the same root (it reduces the gradient) and
        compute in the same dtype on the same device (both use its one full buffer)."""
        for t in self._ties:
            owner = t.owner()
            if owner is None or not any(m is owner for m in instances):
                raise RuntimeError(
                    f"FullyShardedDataParallel: parameter '{t.name}' is shared with an instance that is not under "
                    f"the same root instance; wrap both in one root"
                )
            full = t.handle.full
            if full.dtype is not self.compute_dtype or full.device != self.compute_device:
                raise ValueError(
                    f"FullyShardedDataParallel: parameter '{t.name}' is shared with an instance that computes in "
                    f"{full.dtype} on {full.device}, this one in {self.compute_dtype} on {self.compute_device}; "
                    f"expected the same mixed_precision / compute_dtype and device on both"
                )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        outer = self._is_root and _graph_task() == -1
        if self._is_root:
            self._loop_thread = threading.get_ident()
            self._settle_failed_backward()
        if self.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError("FullyShardedDataParallel: forward inside summon_full_params is not supported")
        # A forward recomputed (activation checkpointing) after this instance's backward began:
        # that backward still reads the full parameters and the attributes' full views.
        in_backward = self.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)
        entry_state = self.training_state
        self.training_state = TrainingState.FORWARD
        # Not a forward recomputed in backward by activation checkpointing: note where autograd's
        # record of this forward starts (see outer_graph_uses_full).
        start = sequence_mark() if _graph_task() == -1 and torch.is_grad_enabled() else None
        if self._is_root and self.mixed_precision:
            args, kwargs = cast_floats(self.compute_dtype, args, kwargs)
        elif self.force_input_to_fp32 and not self.mixed_precision:
            args, kwargs = cast_floats(torch.float32, args, kwargs)
        for h in self._all_handles:
            h.forward_users += 1
        self._outer_forward_running = outer
        try:
            self._check_own_shards()
            self._sync_requires_grad()
            self._rebuild_full_params(refresh=not in_backward)
            self._root._on_forward(self)
            self._use_full_params()
            outputs = self.module(*args, **kwargs)
            if _graph_task() == -1:
                self._outer_uses_full = start is not None and outer_graph_uses_full(outputs, start)
            reached, hidden = self._scan_outputs(outputs)
            if not in_backward:
                self._unreachable_outputs = torch.is_grad_enabled() and not reached
                self._released_in_forward = self.reshard_after_forward and not hidden
            if self._released_in_forward and not in_backward:
                # a graph of gradients may still read the memory (_grads_graph_pending)
                self._free_full_params(in_forward=True, keep_memory=self._root._grads_graph_pending)
                # Until backward (whose hook points them at the gathered buffer again, for a
                # recompute inside the instance), the names must not read released memory.
                self._leave_shaped_views()
            outputs = self._register_pre_backward_hooks(outputs)
        finally:
            self._outer_forward_running = False
            if outer and self._inner_backwards:
                for end in self._inner_backwards:
                    end()
                self._inner_backwards.clear()
            for h in self._all_handles:
                h.forward_users -= 1
            if in_backward:
                if not self.flatten_parameters or self._ties:
                    with torch.enable_grad():
                        self._use_full_params()
                self.training_state = entry_state
            else:
                self._use_shard_params()
                self.training_state = TrainingState.IDLE
        if self.clear_autocast_cache:
            torch.clear_autocast_cache()
        if hidden and self._is_root:  # no pre-backward hook will take them back
            self._take_back_accumulated_grads()
        return outputs

    def _check_own_shards(self) -> None:
        """A parameter slot that no longer holds this instance's shard (``torch.func.functional_call``
        swaps in other tensors) would be ignored: the forward computes with the instance's shards.
        An empty slot is this instance's own doing: a forward recomputed in backward (activation
        checkpointing around the instance) finds the full parameters in place of the shards."""
        for h in self._handles:
            if self.mixed_precision and h.param.dtype is not torch.float32:
                raise RuntimeError(
                    f"FullyShardedDataParallel: mixed_precision=True computes in {self.compute_dtype} from float32 "
                    f"shards, but '{h.backing_name}' is {h.param.dtype} (converted after wrapping, by .half() say): "
                    "call .float(), or convert the module before wrapping it without mixed precision"
                )
            module, attr = (self, h.backing_name) if self.flatten_parameters else h.places()[0]
            held = module._parameters.get(attr)
            if held is not None and held is not h.param:
                raise RuntimeError(
                    f"FullyShardedDataParallel: parameter '{h.backing_name}' is not this instance's shard any more "
                    "(replaced, e.g. by torch.func.functional_call); the forward computes with its own shards and "
                    "would ignore it: change the weights through load_state_dict() or summon_full_params() instead"
                )

    def _on_forward(self, m: "FullyShardedDataParallel") -> None:
        """Root: record the forward order once; afterwards prefetch the instance after `m`."""
        if m is self and self._exec_order:
            self._order_recorded = True  # a second root forward: the order is complete
        if not self._order_recorded:
            if m not in self._exec_order:
                self._exec_order.append(m)
            return
        self._prefetch_neighbour(m, +1)

    def _prefetch_neighbour(self, m: "FullyShardedDataParallel", step: int) -> None:
        """Start the all-gather of the instance `step` places after `m` in forward order. Backward
        runs in reverse, and the root's backward hook fires first, so from the root step -1 means
        the last instance."""
        order = self._exec_order
        if not self._order_recorded or m not in order:
            return
        i = (order.index(m) + step) % len(order)
        if i == 0:  # the root needs no prefetch: it gathers first
            return
        if step > 0:
            order[i]._start_gather(refresh=True)
        elif not order[i]._unreachable_outputs:  # no pre-backward hook will wait for it
            order[i]._start_gather()

    @contextlib.contextmanager
    def no_sync(self) -> Generator:
        """Accumulate full gradients locally; the first backward after the context reduces them."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("FullyShardedDataParallel.no_sync() may only be called on the root instance")
        with _state_dict.override(get_fsdp_instances(self), "_require_backward_grad_sync", False):
            yield

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over all shards (one all-reduce); returns the total norm.
        torch's ``torch.nn.utils.clip_grad_norm_`` does not apply here: on the shards it measures
        this rank's part only, and each rank would clip by a different factor."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("FullyShardedDataParallel.clip_grad_norm_ may only be called on the root instance")
        self._settle_failed_backward()
        self.assert_state(TrainingState.IDLE)
        norm_type = float(norm_type)
        grads = [p.grad.detach() for p in self.parameters() if p.grad is not None]
        measured = grads
        if norm_type < 0:  # -inf (the smallest |g|) and negative p: padding's zeros would count
            layouts = {id(h.param): h.layout for m in self._fsdp_instances for h in m._handles}
            measured = []
            for p in self.parameters():
                if p.grad is None:
                    continue
                g, layout = p.grad.detach().reshape(-1), layouts.get(id(p))
                if layout is not None:  # a shard's real part, or no_sync's full gradient's
                    real = layout.numel if g.numel() > layout.shard_numel else layout.shard_numel - layout.padding
                    g = g[:real]
                if g.numel():
                    measured.append(g)
        total = reduce_norm_term(self.comm, grad_norm_term(measured, norm_type), norm_type).to(norm_dtype(grads))
        clip_coef = float(max_norm) / (float(total) + 1e-6)
        if clip_coef < 1:
            for g in grads:
                if g.device.type == "cpu" and g.is_contiguous():
                    _C.cpu_unscale_inf_check(g, clip_coef, torch.zeros(1))  # g *= clip_coef, in C
                else:
                    g.mul_(clip_coef)
        return total

    # ---------------------------------------------------------------- full parameters

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False) -> Generator:
        """Gather the full fp32 parameters in place under their original names. Edits persist to the
        local shard on exit unless `volatile`. Collective: every rank must enter it."""
        self._settle_failed_backward()
        if recurse:
            with contextlib.ExitStack() as stack:
                # owners first, so an instance that shares their parameters registers the same full ones
                for m in sorted(get_fsdp_instances(self), key=lambda m: bool(m._ties)):
                    stack.enter_context(m.summon_full_params(recurse=False, volatile=volatile))
                yield
            return
        if self.training_state is TrainingState.SUMMON_FULL_PARAMS:
            yield  # already summoned by an outer call
            return
        if self.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"FullyShardedDataParallel.summon_full_params: not allowed during forward or backward "
                f"(state {self.training_state.name})"
            )
        self.training_state = TrainingState.SUMMON_FULL_PARAMS
        try:
            fulls = _state_dict.summon(self)
        except BaseException:
            self.training_state = TrainingState.IDLE
            raise
        try:
            yield
        finally:
            _state_dict.unsummon(self, fulls, write_back=not volatile)
            self._free_full_params()  # any compute-dtype copy is stale now
            self.training_state = TrainingState.IDLE

    # ---------------------------------------------------------------- state dicts

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The full fp32 state with the original keys (collective). Returns {} on ranks other than 0
        when state_dict_on_rank_0_only. Local (sharded) state under local_state_dict()."""
        if not self._return_full_state_dict or self.training_state is TrainingState.SUMMON_FULL_PARAMS:
            return super().state_dict(*args, **kwargs)
        with self.summon_full_params(recurse=True, volatile=True):
            sd = super().state_dict(*args, **kwargs)
            sd = _state_dict.detach_to(sd, self.state_dict_device, self.mixed_precision)
        if self.state_dict_on_rank_0_only and self.rank != 0:
            return type(sd)()
        return sd

    def local_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The sharded state: keys ``<fsdp path>.flat_param_<i>`` plus buffers, FairScale's format."""
        self._settle_failed_backward()
        self.assert_state([TrainingState.IDLE, TrainingState.FORWARD])
        with _state_dict.local_mode(get_fsdp_instances(self)):
            sd = super().state_dict(*args, **kwargs)
        _state_dict.unflattened_shards(_named_instances(self), sd)
        if self.mixed_precision:  # buffers kept in the compute dtype are saved in fp32, as in FairScale
            for k, v in sd.items():
                if torch.is_tensor(v) and v.is_floating_point() and v.dtype is not torch.float32:
                    sd[k] = v.float()
        return sd

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load a full state dict (as state_dict() returns). Collective."""
        if not self._return_full_state_dict:
            return super().load_state_dict(state_dict, strict)
        with self.summon_full_params(recurse=True, volatile=False):
            return super().load_state_dict(state_dict, strict)

    def load_local_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load a local (sharded) state dict saved by local_state_dict() at the same world size."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                "FullyShardedDataParallel.load_local_state_dict: argument 'state_dict' must be a mapping "
                f"(what local_state_dict() returns), got {type(state_dict).__name__}"
            )
        self._settle_failed_backward()
        self.assert_state(TrainingState.IDLE)
        instances = get_fsdp_instances(self)
        named = _named_instances(self)
        _state_dict.check_local_shards(named, state_dict)
        with _state_dict.local_mode(instances):
            state_dict = _state_dict.shaped_for_load(named, super().state_dict(), state_dict)
            result = super().load_state_dict(state_dict, strict)
        for m in instances:
            m._free_full_params()
        return result

    def local_metadata_dict(self) -> Dict[str, Any]:
        """What consolidate_shard_weights needs to rebuild full weights offline: FairScale's format,
        plus top-level ``rank`` and ``world_size`` (FairScale's readers ignore them)."""
        return _state_dict.local_metadata(self, _named_instances(self))

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: List[Dict[str, torch.Tensor]],
        shard_metadata: List[Dict[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> Dict[str, torch.Tensor]:
        """Rebuild a full state dict from every rank's local_state_dict() and local_metadata_dict().
        Shards whose metadata carry ``rank`` / ``world_size`` (ours) are put in rank order, whatever
        order they come in, and a set with a missing, duplicate or out-of-range rank, mixed world
        sizes or inconsistent metadata is a ValueError; FairScale's shards are taken in the order
        given."""
        return _state_dict.consolidate(shard_weights, shard_metadata, with_module_buffers, strict)

    def gather_full_optim_state_dict(self, optim: torch.optim.Optimizer, **ignored: Any) -> Optional[Dict[str, Any]]:
        """Collective: rank 0 gets the optimizer state unsharded and keyed like the unwrapped model's
        parameters; other ranks get None."""
        return _optim_state.gather_full(self, get_fsdp_instances(self), optim)

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's shard of a state from gather_full_optim_state_dict(), for optim.load_state_dict."""
        return _optim_state.shard_from_full(get_fsdp_instances(self), full_optim_state_dict)


def _compute_device_of(module: nn.Module, compute_device: Optional[Any]) -> torch.device:
    """`compute_device`, else the device of the first parameter no nested instance manages, else CPU."""
    if compute_device is not None:
        return torch.device(compute_device)
    first = next((p for p in module.parameters() if not is_managed(p)), None)
    return first.device if first is not None else torch.device("cpu")


def get_fsdp_instances(mod: nn.Module, skip_empty: bool = False) -> List[FullyShardedDataParallel]:
    """Every FSDP instance in `mod` (itself included), in module order."""
    return [m for m in mod.modules() if isinstance(m, FullyShardedDataParallel) and not (skip_empty and not m._handles)]


def _named_instances(root: nn.Module) -> List[Tuple[str, FullyShardedDataParallel]]:
    """(path without wrapper names, instance) for every FSDP instance in `root`, in module order."""
    return [(_state_dict.clean_path(p), m) for p, m in root.named_modules() if isinstance(m, FullyShardedDataParallel)]


def _own_buffers(fsdp: FullyShardedDataParallel):
    """(module, name, buffer) for the buffers under `fsdp` that no nested instance owns."""
    stack = [fsdp.module]
    while stack:
        mod = stack.pop()
        for name, buf in list(mod._buffers.items()):
            if buf is not None:
                yield mod, name, buf
        stack.extend(c for c in mod.children() if not isinstance(c, FullyShardedDataParallel))


def auto_wrap_bn(
    module: nn.Module,
    single_rank_pg: bool = False,
    process_group: Optional[Any] = None,
    fsdp_config: Optional[Dict[str, Any]] = None,
    wrap_it: bool = True,
    assert_on_collision: bool = True,
) -> nn.Module:
    """Wrap every BatchNorm in its own fp32, unflattened FSDP instance that keeps its parameters
    gathered (FairScale's helper, same defaults). Call it on every rank."""
    from ..wrap import auto_wrap, config_auto_wrap_policy, enable_wrap

    pg = process_group
    if single_rank_pg:
        import torch.distributed as dist

        # new_group is collective: every rank creates every single-rank group and keeps its own.
        mine = dist.get_rank()
        for r in range(dist.get_world_size()):
            g = dist.new_group([r])
            if r == mine:
                pg = g
    if fsdp_config is None:
        fsdp_config = {
            "process_group": pg,
            "mixed_precision": False,
            "flatten_parameters": False,
            "reshard_after_forward": False,
            "bucket_cap_mb": 0,
            "force_input_to_fp32": False,
        }
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if assert_on_collision and hasattr(m, "wrapper_config"):
                raise AssertionError(
                    "auto_wrap_bn: module already has a wrapper_config; is it tagged already by another policy?"
                )
            m.wrapper_config = fsdp_config
    ctx = (
        enable_wrap(config_auto_wrap_policy, wrapper_cls=FullyShardedDataParallel)
        if wrap_it
        else contextlib.nullcontext()
    )
    with ctx:
        return auto_wrap(module)
