"""fairscale_c.nn — mirrors fairscale.nn."""

from .data_parallel import FullyShardedDataParallel
from .wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap

__all__ = [
    "FullyShardedDataParallel",
    "auto_wrap",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "wrap",
]
