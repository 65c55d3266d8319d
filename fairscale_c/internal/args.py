"""Whole-number arguments as FairScale takes them: a Python int, or any integer scalar with
``__index__`` (numpy's, e.g. read from an array or a config), never a bool."""

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


__all__ = ["as_int"]
