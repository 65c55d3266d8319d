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


__all__ = ["as_int", "refuse_sparse_gradients"]
