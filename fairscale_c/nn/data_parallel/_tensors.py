"""The tensors inside a forward's inputs and outputs (nested containers, named tuples, mapping
subclasses such as HuggingFace's ModelOutput, dataclasses), mapped or cast while the containers
keep their types."""

import copy
import dataclasses
from typing import Any, Tuple

import torch


def map_tensors(fn, obj: Any) -> Any:
    """`obj` with `fn` applied to every tensor in it; dicts, lists, tuples and named tuples are
    rebuilt as their own types, other mappings updated in place, dataclass instances copied
    (frozen ones too) with their fields mapped."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items()) if type(obj) is dict else _map_dict(fn, obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):  # an init=False field may be unset
                object.__setattr__(out, f.name, map_tensors(fn, getattr(obj, f.name)))
        return out
    return obj


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def scan_outputs(obj: Any) -> Tuple[bool, Any]:
    """(whether a tensor in `obj` that map_tensors reaches requires grad, and when none does but
    `obj` holds an object map_tensors does not look into (any object but a tensor, a container it
    walks or a plain value, which may hold tensors), that object's type, otherwise None)."""
    grad: list = []
    opaque: list = []
    _scan(obj, grad, opaque)
    reached = any(grad)
    return reached, (opaque[0] if opaque and not reached else None)


def _scan(x: Any, grad: list, opaque: list) -> None:
    # Module level, not a closure calling itself: that would be a reference cycle per call,
    # garbage that only the cycle collector frees (and never, with gc disabled).
    if torch.is_tensor(x):
        grad.append(x.requires_grad)
    elif isinstance(x, dict):
        for v in x.values():
            _scan(v, grad, opaque)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _scan(v, grad, opaque)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            _scan(getattr(x, f.name, None), grad, opaque)
    elif not isinstance(x, _PLAIN):
        opaque.append(type(x))


def _map_dict(fn, obj: Any) -> Any:
    # Mapping subclasses such as HuggingFace ModelOutput: update in place to keep the type.
    for k in list(obj.keys()):
        obj[k] = map_tensors(fn, obj[k])
    return obj


_NARROW = (torch.float32, torch.float16, torch.bfloat16)


def cast_floats(dtype: torch.dtype, args: Any, kwargs: Any):
    """(args, kwargs) with every float32, float16 and bfloat16 tensor cast to `dtype`; float64
    ones (a position, a timestamp: FairScale leaves them too) and the others as they are. Autograd
    records the casts, so gradients reach the inputs (a layer before the instance, a gradient with
    respect to them)."""

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.dtype in _NARROW and x.dtype is not dtype else x

    return map_tensors(cast, args), map_tensors(cast, kwargs)
