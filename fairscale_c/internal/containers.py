"""Container helpers of fairscale.internal.containers: applying a function to every tensor (or
every object of a kind) inside nested dicts, lists, tuples, named tuples and sets; packing keyword
arguments into a flat tuple and back; splitting tensors from other objects and back. Misuse that
FairScale asserts on raises AssertionError here too (explicitly, so also under ``python -O``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = [
    "apply_to_type",
    "apply_to_tensors",
    "to_np",
    "from_np",
    "pack_kwargs",
    "unpack_kwargs",
    "split_non_tensors",
    "unpack_non_tensors",
]


def apply_to_type(type_fn: Callable[[Any], bool], fn: Callable[[Any], Any], container: Any) -> Any:
    """`container` rebuilt with `fn(x)` in place of every x for which `type_fn(x)` holds. A
    PackedSequence has `fn` applied to its data and is returned as it is."""

    def walk(x: Any) -> Any:
        if type_fn(x):
            return fn(x)
        if isinstance(x, OrderedDict):
            out = x.__class__()
            for k, v in x.items():
                out[k] = walk(v)
            return out
        if isinstance(x, PackedSequence):
            walk(x.data)
            return x
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            if hasattr(x, "_fields"):  # a named tuple: rebuilt by field
                return type(x)(**{k: walk(v) for k, v in x._asdict().items()})
            return tuple(walk(v) for v in x)
        if isinstance(x, set):
            return {walk(v) for v in x}
        return x

    return walk(container)


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], container: Any) -> Any:
    """apply_to_type for tensors."""
    return apply_to_type(torch.is_tensor, fn, container)


def to_np(tensor_or_container: Any) -> Any:
    """Every tensor as a numpy array (through the CPU)."""
    return apply_to_type(torch.is_tensor, lambda t: t.cpu().numpy(), tensor_or_container)


def from_np(ndarray_or_container: Any) -> Any:
    """Every numpy array as a tensor sharing its memory."""
    return apply_to_type(lambda x: isinstance(x, np.ndarray), torch.from_numpy, ndarray_or_container)


def pack_kwargs(*args: Any, **kwargs: Any) -> Tuple[Tuple[str, ...], Tuple[Any, ...]]:
    """(keyword names, positional values then keyword values): pack_kwargs(1, 2, a=3) gives
    (("a",), (1, 2, 3))."""
    return tuple(kwargs), tuple(args) + tuple(kwargs.values())


def unpack_kwargs(kwarg_keys: Tuple[str, ...], flat_args: Tuple[Any, ...]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The inverse of pack_kwargs: (positional values, keyword dict)."""
    if len(kwarg_keys) > len(flat_args):
        raise AssertionError(f"unpack_kwargs: too many keys {len(kwarg_keys)} vs. {len(flat_args)}")
    if not kwarg_keys:
        return flat_args, {}
    split = len(flat_args) - len(kwarg_keys)
    return flat_args[:split], dict(zip(kwarg_keys, flat_args[split:]))


def split_non_tensors(mixed: Any) -> Tuple[Tuple[torch.Tensor, ...], Optional[Dict[str, List[Any]]]]:
    """A tensor gives ((tensor,), None); a tuple gives (its tensors, {"is_tensor": [...],
    "objects": [the other items]}) for unpack_non_tensors."""
    if isinstance(mixed, torch.Tensor):
        return (mixed,), None
    is_tensor = [isinstance(o, torch.Tensor) for o in mixed]
    tensors = tuple(o for o, t in zip(mixed, is_tensor) if t)
    objects = [o for o, t in zip(mixed, is_tensor) if not t]
    return tensors, {"is_tensor": is_tensor, "objects": objects}


def unpack_non_tensors(
    tensors: Tuple[torch.Tensor, ...], packed_non_tensors: Optional[Dict[str, List[Any]]]
) -> Tuple[Any, ...]:
    """The inverse of split_non_tensors."""
    if packed_non_tensors is None:
        return tensors
    if not isinstance(packed_non_tensors, dict):
        raise AssertionError(
            f"unpack_non_tensors: expected the dict split_non_tensors made, got {type(packed_non_tensors)}"
        )
    flags, objects = packed_non_tensors["is_tensor"], packed_non_tensors["objects"]
    if len(tensors) + len(objects) != len(flags):
        raise AssertionError(
            f"unpack_non_tensors: len(tensors) {len(tensors)} len(objects) {len(objects)} "
            f"len(is_tensor_list) {len(flags)}"
        )
    its, ito = iter(tensors), iter(objects)
    return tuple(next(its) if flag else next(ito) for flag in flags)
