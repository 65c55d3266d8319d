"""Activation checkpointing with FairScale 0.4.13's API: ``checkpoint_wrapper(module,
offload_to_cpu=False)`` returns the same module, whose forward from then on keeps only its inputs
and recomputes everything else in backward.

Built on torch.utils.checkpoint's non-reentrant mode, which brings keyword arguments, non-tensor
outputs, the RNG state (CPU and CUDA) and the autocast state of the first pass to the
recomputation, and works inside FSDP (``FSDP(checkpoint_wrapper(block))``, as FairScale
recommends). ``is_checkpointing()`` is true during the first pass of a wrapped forward,
``is_recomputing()`` during its recomputation; BatchNorm layers inside a wrapped module update
their running statistics in the first pass only, so they end as without checkpointing.
"""

import contextlib
import functools
import threading
import weakref
from typing import Any, Dict, Generator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .checkpoint_utils import patch_batchnorm  # noqa: F401 (FairScale's module re-exports it)

_CONTAINER_HELPERS = ("pack_kwargs", "split_non_tensors", "unpack_kwargs", "unpack_non_tensors")


def __getattr__(name: str) -> Any:
    """FairScale's module also offers its container helpers; they live in
    fairscale_c.internal.containers, imported on first use (it needs numpy, which this module
    does not)."""
    if name in _CONTAINER_HELPERS:
        from ...internal import containers

        return getattr(containers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _State(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False
        self.is_checkpointing_disabled = False
        self.frozen: list = []  # BatchNorm layers whose statistics this thread's recomputation froze


_state = _State()

# FairScale's names for the per-thread flags (the same attributes: is_checkpointing,
# is_recomputing, is_checkpointing_disabled)
ThreadLocalCheckpointingState = _State
thread_local = _state


def get_rng_state() -> Dict[str, Any]:
    """The CPU generator's state, and the current CUDA device's when CUDA is available, as a dict
    for set_rng_state (FairScale's helper)."""
    state = {"torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what get_rng_state returned."""
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])


def is_autocast_enabled() -> bool:
    """``torch.is_autocast_enabled()``: the CUDA autocast state, as FairScale's helper returns."""
    return torch.is_autocast_enabled()


@contextlib.contextmanager
def _flag(name: str, value: bool = True) -> Generator[None, None, None]:
    before = getattr(_state, name)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, before)


def disable_checkpointing():
    """While inside, wrapped modules run their plain forward (FairScale's context manager)."""
    return _flag("is_checkpointing_disabled")


def enable_checkpointing():
    """Makes is_checkpointing() true while inside."""
    return _flag("is_checkpointing")


@contextlib.contextmanager
def enable_recomputing() -> Generator[None, None, None]:
    """Makes is_recomputing() true while inside. On leaving, BatchNorm layers frozen inside get
    their settings back, also those whose forward did not return: torch's checkpoint stops a
    recomputation as soon as it has every saved tensor, which can be inside a BatchNorm's
    forward, before its forward hooks."""
    before, pending = _state.is_recomputing, len(_state.frozen)
    _state.is_recomputing = True
    try:
        yield
    finally:
        _state.is_recomputing = before
        while len(_state.frozen) > pending:
            _thaw(_state.frozen.pop())


def is_checkpointing() -> bool:
    """Whether this thread is in the first pass of a checkpointed forward."""
    return _state.is_checkpointing


def is_recomputing() -> bool:
    """Whether this thread is recomputing a checkpointed forward in backward. Use it to keep a
    forward's side effects (counters, statistics) from happening twice."""
    return _state.is_recomputing


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Make `module`'s forward checkpointed and return `module` itself.

    offload_to_cpu: keep the saved inputs (the activations entering the module) in host memory
    between forward and backward; they are copied back to their device for the recomputation.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper: argument 'module' must be an nn.Module, got {type(module).__name__}")
    _patch_batchnorm(module)
    module.forward = functools.partial(_checkpointed_forward, type(module).forward, _ModuleRef(module), offload_to_cpu)
    return module


class _ModuleRef:
    """A weak reference from a wrapped module's forward to the module (a strong one would be a
    cycle) that follows the module when it is copied: ``copy.deepcopy`` points the copy's forward
    at the copy (a plain weakref would keep running the original's parameters), and pickling
    (``torch.save`` of a model) stores the module itself, which pickle restores as one object."""

    __slots__ = ("_ref",)

    def __init__(self, module: nn.Module) -> None:
        self._ref = weakref.ref(module)

    def __call__(self) -> nn.Module:
        return self._ref()

    def __deepcopy__(self, memo: dict) -> "_ModuleRef":
        module = self._ref()
        return _ModuleRef(memo.get(id(module), module))

    def __reduce__(self) -> Any:
        return (_ModuleRef, (self._ref(),))


def _checkpointed_forward(original_forward: Any, weak_self: Any, offload_to_cpu: bool, *args: Any, **kwargs: Any):
    module = weak_self()
    if not torch.is_grad_enabled() or _state.is_checkpointing_disabled:
        return original_forward(module, *args, **kwargs)
    devices = [a.device if torch.is_tensor(a) else None for a in args]
    if offload_to_cpu:  # what the checkpoint keeps for backward is then the host copy
        args = tuple(a.to("cpu", non_blocking=True) if torch.is_tensor(a) else a for a in args)
    passes = []

    def run(*inputs: Any) -> Any:
        if offload_to_cpu:
            inputs = tuple(x.to(d, non_blocking=True) if d is not None else x for x, d in zip(inputs, devices))
        first = not passes
        passes.append(None)
        with enable_checkpointing() if first else enable_recomputing():
            return original_forward(module, *inputs, **kwargs)

    return torch_checkpoint.checkpoint(run, *args, use_reentrant=False)


def _freeze_stats_when_recomputing(bn: _BatchNorm, inputs: Any) -> None:
    # Momentum 0 leaves the running statistics as they are while the op (and so what autograd
    # saves, which the checkpoint compares between the passes) stays the same.
    if _state.is_recomputing and bn.training and bn.track_running_stats:
        tracked = bn.num_batches_tracked.clone() if bn.num_batches_tracked is not None else None
        bn._fsc_saved_stats = (bn.momentum, tracked)
        bn.momentum = 0.0
        _state.frozen.append(bn)


def _restore_stats_settings(bn: _BatchNorm, inputs: Any, output: Any) -> None:
    if _thaw(bn) and bn in _state.frozen:
        _state.frozen.remove(bn)


def _thaw(bn: _BatchNorm) -> bool:
    """Give `bn` back the momentum and batch count saved by _freeze_stats_when_recomputing;
    False if nothing was saved."""
    saved = bn.__dict__.pop("_fsc_saved_stats", None)
    if saved is None:
        return False
    bn.momentum = saved[0]
    if saved[1] is not None:
        with torch.no_grad():
            bn.num_batches_tracked.copy_(saved[1])
    return True


def _patch_batchnorm(module: nn.Module) -> None:
    """BatchNorm layers must not update their running statistics a second time while the
    forward is recomputed (FairScale patches them for the same reason). A layer with a
    ``disable_patch_batchnorm`` attribute (SyncBatchNorm) keeps its statistics itself and is left
    alone, as in FairScale."""
    for child in module.modules():
        if (
            isinstance(child, _BatchNorm)
            and not hasattr(child, "disable_patch_batchnorm")
            and not getattr(child, "_fsc_bn_patched", False)
        ):
            child.register_forward_pre_hook(_freeze_stats_when_recomputing)
            child.register_forward_hook(_restore_stats_settings)
            child._fsc_bn_patched = True
