"""Tensor hooks that hold their module weakly.

A hook registered on a tensor lives in that tensor's hook table, which Python's garbage collector
does not look through (torch owns it). A hook that refers to its module strongly (a bound method,
a partial of one) therefore keeps the module, and everything it holds, alive for as long as the
tensor lives, even when the tensor's only owner is that same module: a cycle nobody can collect.
The module's process groups, buffers and threads then outlive it."""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_hook(method: Callable[..., Any], *refs: Any) -> Callable[..., Any]:
    """A hook calling ``method(*args, *hook_args)`` while ``method``'s instance lives, where each of
    ``refs`` is held weakly too (objects that lead back to the hooked tensor) and passed as the
    object itself; once any of them is gone the hook does nothing."""
    owner = weakref.WeakMethod(method)
    held = [weakref.ref(r) for r in refs]

    def hook(*hook_args: Any) -> Any:
        bound = owner()
        args = [r() for r in held]
        if bound is None or any(a is None for a in args):
            return None
        return bound(*args, *hook_args)

    return hook


__all__ = ["weak_hook"]
