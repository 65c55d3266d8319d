"""Imported at start-up by every Python process of the fairscale_c side of
tools/fairscale_tests/run.py (this folder is first on its PYTHONPATH, so spawned ranks get it too).

``fairscale.<sub>`` is fairscale_c's module wherever fairscale_c provides one (the alias of
fairscale_c.compat); every other ``fairscale.<sub>`` (the tests' helpers in ``fair_dev``) is
FairScale's own file from FAIRSCALE_C_REFERENCE, the reference installation."""

import importlib
import importlib.abc
import importlib.util
import os
import sys

import fairscale_c.compat

_REFERENCE = os.environ["FAIRSCALE_C_REFERENCE"]  # the folder that holds FairScale's package


class _FromReference(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("fairscale."):
            return None
        try:
            if importlib.util.find_spec("fairscale_c" + fullname[len("fairscale") :]) is not None:
                return None  # fairscale_c's own module: the alias serves it
        except ModuleNotFoundError:
            pass
        base = os.path.join(_REFERENCE, *fullname.split("."))
        if os.path.isdir(base):
            init = os.path.join(base, "__init__.py")
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[base])
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(fullname, base + ".py")
        return None


fairscale_c.compat.install()
sys.meta_path.insert(0, _FromReference())
