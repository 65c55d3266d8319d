"""fairscale_c.experimental.nn — mirrors fairscale.experimental.nn: SyncBatchNorm (docs/experimental.md).
FairScale's OffloadModel and MEVO are not provided."""

from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
