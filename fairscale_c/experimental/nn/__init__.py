"""fairscale_c.experimental.nn — mirrors fairscale.experimental.nn: SyncBatchNorm, MEVO (with
BaselineSoftmaxNllLoss) and ``auto_shard.shard_model`` (docs/experimental.md). FairScale's
OffloadModel is not provided."""

from .mevo import BaselineSoftmaxNllLoss
from .mevo import MemoryEfficientVocabOutput as MEVO
from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "MEVO", "BaselineSoftmaxNllLoss"]
