"""fairscale_c.internal — mirrors fairscale.internal, FairScale's helper modules that user code and
tests import: ``parallel`` (ProcessGroupName, get_process_group_cached, chunk_and_pad, ...),
``containers``, ``params``, ``state_dict``, ``object`` and ``version`` (``torch_version``, also
here at the top as in FairScale)."""

from .._submodules import lazy_submodules
from .version import torch_version

__all__ = ["torch_version"]

__getattr__ = lazy_submodules(
    __name__,
    (
        "args",
        "containers",
        "copying",
        "hooks",
        "object",
        "parallel",
        "params",
        "reduce_scatter_bucketer",
        "state_dict",
        "version",
    ),
)
