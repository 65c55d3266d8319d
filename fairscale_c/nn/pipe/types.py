"""fairscale.nn.pipe.types' public class: LazyModule."""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["LazyModule"]


class LazyModule:
    """``LazyModule(function)``: a module to be built later, by calling it (``lazy()`` returns
    ``function()``), as FairScale's. FairScale's RPC-based AsyncPipe takes lists of them so that each
    rank builds only its own partition; that pipe is not provided here (docs/migration.md)."""

    def __init__(self, function: Callable[[], nn.Module]):
        if not callable(function):
            raise TypeError(f"LazyModule: argument 'function' must be callable, got {type(function).__name__}")
        self.function = function

    def __call__(self) -> nn.Module:
        return self.function()
