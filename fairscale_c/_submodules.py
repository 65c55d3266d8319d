"""Subpackages reachable as attributes of their package before anything imported them, as
FairScale's eager imports make them (``import fairscale; fairscale.nn.FullyShardedDataParallel``);
here they are imported on first use, so ``import fairscale_c`` stays light."""

import importlib
from typing import Any, Callable, Iterable


def lazy_submodules(package: str, names: Iterable[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports the submodules ``names`` on access."""
    known = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name in known:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
