"""copy.deepcopy for modules that hold process groups."""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable


def deepcopy_sharing(module: Any, memo: Dict[int, Any], shared: Iterable[Any]) -> Any:
    """``copy.deepcopy(module)`` in which the objects of ``shared`` (process groups: handles to
    communication set up with other processes, which cannot be copied or pickled) are referred to
    by the copy as they are, everything else copied as deepcopy copies a module."""
    for obj in shared:
        if obj is not None:
            memo[id(obj)] = obj
    new = type(module).__new__(type(module))
    memo[id(module)] = new
    new.__setstate__(copy.deepcopy(module.__dict__, memo))
    return new
