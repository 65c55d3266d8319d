"""fairscale_c: FairScale's large-scale training primitives with a C core.

Existing FairScale code moves over by changing ``fairscale`` to ``fairscale_c`` in imports.
"""

from typing import Any, Dict

from . import _C
from ._submodules import lazy_submodules
from ._C import DistributedError
from ._version import __version__

__version_tuple__ = tuple(int(p) if p.isdigit() else p for p in __version__.split("."))

__all__ = ["DistributedError", "__version__", "build_info"]

__getattr__ = lazy_submodules(__name__, ("distributed", "experimental", "internal", "nn", "optim", "utils", "version"))


def build_info() -> Dict[str, Any]:
    """What this build contains and what it found at run time.

    Keys: ``version``, ``compiler``, ``c_standard``, ``dlpack_version``, ``cuda_kernels_built``
    (compiled in when nvcc was present at build time), and, discovered at run time by dlopen
    (see ``_C.gpu_info()``): ``driver_found`` / ``driver_version`` / ``driver_path``, ``runtime_found`` /
    ``runtime_version`` / ``runtime_path``, ``nccl_version`` / ``nccl_path``, ``device_count``,
    ``kernels_built`` and ``error`` (why a library was not usable, if any).
    """
    info = dict(_C._build_info())
    gpu_info = getattr(_C, "gpu_info", None)
    if gpu_info is not None:
        info.update(gpu_info())
    return info
