"""``import fairscale`` served by fairscale_c: code written for FairScale 0.4.13 runs unchanged.

::

    import fairscale_c.compat
    fairscale_c.compat.install()
    from fairscale.nn.data_parallel import FullyShardedDataParallel   # fairscale_c's class

or, with no change to the script at all::

    python -m fairscale_c.compat train.py --its --arguments

After :func:`install`, ``fairscale`` and ``fairscale.<sub>`` for every module fairscale_c provides
(``fairscale.nn``, ``.nn.data_parallel``, ``.nn.checkpoint``, ``.nn.wrap``, ``.nn.pipe``, ...) are the very module
objects of ``fairscale_c`` and ``fairscale_c.<sub>``: ``fairscale.nn.FullyShardedDataParallel is
fairscale_c.nn.FullyShardedDataParallel``. A FairScale module that fairscale_c does not provide
(for example ``fairscale.fair_dev``, FairScale's test helpers) raises an
ImportError that names it; docs/migration.md lists what is provided.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

import fairscale_c

__all__ = ["install", "uninstall", "is_installed", "FAIRSCALE_VERSION", "version_string", "SHIM_DIR"]

ALIAS = "fairscale"
TARGET = "fairscale_c"
FAIRSCALE_VERSION = "0.4.13"  # the FairScale release whose API fairscale_c provides


def version_string() -> str:
    """What ``fairscale.__version__`` says under the alias: the FairScale API version and the
    fairscale_c release that provides it, e.g. ``0.4.13+fairscale_c.0.1.0``."""
    return f"{FAIRSCALE_VERSION}+fairscale_c.{fairscale_c.__version__}"


class _AliasModule(ModuleType):
    """The ``fairscale`` top-level module: fairscale_c's attributes, with FairScale's version
    attributes. Submodules are fairscale_c's own module objects (see _AliasFinder)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(fairscale_c, name)

    def __dir__(self) -> list:
        return sorted(set(dir(fairscale_c)) | set(self.__dict__))


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        try:
            module = importlib.import_module(self.target)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (exc.name == self.target or self.target.startswith(exc.name + ".")):
                missing = ALIAS + self.target[len(TARGET) :]
                raise ModuleNotFoundError(
                    f"{missing} is not provided by fairscale_c {fairscale_c.__version__} (the fairscale alias of "
                    f"fairscale_c.compat maps it to {self.target}, which does not exist); see docs/migration.md",
                    name=spec.name,
                ) from None
            raise
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # fairscale_c's module, already executed by its own import. The import system has set its
        # __spec__ to the alias's; it keeps its own (fairscale_c.nn.__spec__.name stays "fairscale_c.nn").
        module.__spec__ = self.own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``fairscale.<sub>`` to ``fairscale_c.<sub>`` (the same module object)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if not fullname.startswith(ALIAS + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(TARGET + fullname[len(ALIAS) :]))


_finder = _AliasFinder()
# The folder of _shim/fairscale.py: on PYTHONPATH, child processes import it as ``fairscale``.
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")


def _pythonpath_without_shim() -> list:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SHIM_DIR]


def is_installed() -> bool:
    """Whether ``fairscale`` currently names fairscale_c (install() ran and was not undone)."""
    return isinstance(sys.modules.get(ALIAS), _AliasModule)


def _real_fairscale_loaded() -> Optional[ModuleType]:
    mod = sys.modules.get(ALIAS)
    if mod is not None and not isinstance(mod, _AliasModule):
        return mod
    for name, m in list(sys.modules.items()):
        if name.startswith(ALIAS + ".") and m is not None and not getattr(m, "__name__", "").startswith(TARGET):
            return m
    return None


def install() -> None:
    """Make ``import fairscale`` (and its submodules) resolve to fairscale_c. Idempotent.

    Child Python processes get the alias too (``multiprocessing`` and
    ``torch.multiprocessing.spawn`` workers, ``subprocess``): install() puts the folder of a
    ``fairscale`` module that installs it on ``PYTHONPATH`` and ``sys.path`` (:data:`SHIM_DIR`;
    uninstall() takes it off). A spawned worker runs no code of the program's ``__main__``:
    Tango's workers, for example, resolve the ``"fairscale"`` engine by importing
    ``tango.integrations.fairscale`` (which imports ``fairscale``) and, without the alias, silently
    find no such engine.

    RuntimeError when the real FairScale package is already imported in this process: its
    modules and classes would then be mixed with fairscale_c's (install() before anything imports
    fairscale, or do not install FairScale next to fairscale_c)."""
    if is_installed():
        return
    real = _real_fairscale_loaded()
    if real is not None:
        where = getattr(real, "__file__", None) or "an unknown location"
        raise RuntimeError(
            f"fairscale_c.compat.install(): the real FairScale package is already imported ({real.__name__} from "
            f"{where}); call install() before anything imports fairscale, or uninstall FairScale"
        )
    top = _AliasModule(ALIAS, fairscale_c.__doc__)
    top.__version__ = version_string()
    top.__version_tuple__ = tuple(int(p) for p in FAIRSCALE_VERSION.split("."))
    top.__path__ = []  # a package: submodule imports go through the finder
    top.__spec__ = importlib.machinery.ModuleSpec(ALIAS, None, is_package=True)
    top.__all__ = []
    top.__fairscale_c__ = fairscale_c
    sys.meta_path.insert(0, _finder)
    sys.modules[ALIAS] = top
    # As fairscale/__init__.py imports fairscale.nn, the alias imports it (and fairscale.optim).
    importlib.import_module(ALIAS + ".nn")
    importlib.import_module(ALIAS + ".optim")
    os.environ["PYTHONPATH"] = os.pathsep.join([SHIM_DIR, *_pythonpath_without_shim()])
    if SHIM_DIR not in sys.path:  # multiprocessing's spawn gives its workers this process's sys.path
        sys.path.insert(0, SHIM_DIR)


def uninstall() -> None:
    """Undo install(): ``fairscale`` and the ``fairscale.<sub>`` entries it created are forgotten
    (fairscale_c's modules themselves are untouched)."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    while SHIM_DIR in sys.path:
        sys.path.remove(SHIM_DIR)
    if SHIM_DIR in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        rest = _pythonpath_without_shim()
        if rest:
            os.environ["PYTHONPATH"] = os.pathsep.join(rest)
        else:
            del os.environ["PYTHONPATH"]
    if not is_installed():
        return
    for name, mod in list(sys.modules.items()):
        if name == ALIAS or (name.startswith(ALIAS + ".") and getattr(mod, "__name__", "").startswith(TARGET)):
            del sys.modules[name]
