"""fairscale_c.nn — mirrors fairscale.nn."""

from .checkpoint import checkpoint_wrapper
from .data_parallel import FullyShardedDataParallel, ShardedDataParallel
from .misc import FlattenParamsWrapper
from .moe import MOELayer, Top2Gate
from .pipe import Pipe, PipeRPCWrapper
from .._submodules import lazy_submodules
from .wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap

__all__ = [
    "FullyShardedDataParallel",
    "ShardedDataParallel",
    "FlattenParamsWrapper",
    "MOELayer",
    "Top2Gate",
    "Pipe",
    "PipeRPCWrapper",
    "checkpoint_wrapper",
    "auto_wrap",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "wrap",
]

__getattr__ = lazy_submodules(__name__, ("model_parallel",))
