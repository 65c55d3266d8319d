"""fairscale_c.experimental.nn — mirrors fairscale.experimental.nn: SyncBatchNorm, and
``auto_shard.shard_model`` (docs/experimental.md). FairScale's OffloadModel and MEVO are not
provided."""

from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
