"""fairscale_c.experimental.nn — mirrors fairscale.experimental.nn: SyncBatchNorm, MEVO (with
BaselineSoftmaxNllLoss), OffloadModel and ``auto_shard.shard_model`` (docs/experimental.md)."""

from .mevo import BaselineSoftmaxNllLoss
from .mevo import MemoryEfficientVocabOutput as MEVO
from .offload import OffloadModel
from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "MEVO", "BaselineSoftmaxNllLoss", "OffloadModel"]
