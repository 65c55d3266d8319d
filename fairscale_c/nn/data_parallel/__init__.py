"""fairscale_c.nn.data_parallel — mirrors fairscale.nn.data_parallel."""

from .fully_sharded_data_parallel import (
    FullyShardedDataParallel,
    ProcessGroupName,
    TrainingState,
    auto_wrap_bn,
    get_fsdp_instances,
)
from ._state_dict import no_pre_load_state_dict_hook
from .sharded_ddp import ShardedDataParallel

__all__ = [
    "FullyShardedDataParallel",
    "ProcessGroupName",
    "TrainingState",
    "auto_wrap_bn",
    "get_fsdp_instances",
    "no_pre_load_state_dict_hook",
    "ShardedDataParallel",
]
