"""Argument checks shared by the features. Whole-number arguments as FairScale takes them: a
Python int, or any integer scalar with ``__index__`` (numpy's, e.g. read from an array or a
config), never a bool."""

from __future__ import annotations

import operator
from typing import Any, Optional


def as_int(value: Any) -> Optional[int]:
    """``value`` as a Python int when it is a whole number given as an int or an integer scalar
    (``operator.index``), else None (bools, floats, strings, None, ...)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        return None


def refuse_sparse_gradients(module: Any, where: str) -> None:
    """ValueError when ``module`` holds an embedding that makes sparse gradients: the data-parallel
    wrappers reduce dense gradients only."""
    from torch import nn

    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise ValueError(
                f"{where}: argument 'module' holds {type(m).__name__} {name or '(the module)'!r} with sparse=True; "
                "its sparse gradients cannot be reduced: build it with sparse=False"
            )


def refuse_meta_tensors(module: Any, where: str) -> None:
    """ValueError when a parameter or buffer of ``module`` is on the meta device: the wrappers copy,
    shard and broadcast the values at construction, and a meta tensor has none."""
    tensors = [("parameter", n, t) for n, t in module.named_parameters()]
    tensors += [("buffer", n, t) for n, t in module.named_buffers()]
    for kind, name, t in tensors:
        if t.is_meta:
            raise ValueError(
                f"{where}: argument 'module' has {kind} {name!r} on the meta device; materialise the module "
                "before wrapping it (module.to_empty(device=...), then initialise the values, e.g. with "
                "each submodule's reset_parameters())"
            )


__all__ = ["as_int", "refuse_meta_tensors", "refuse_sparse_gradients"]
