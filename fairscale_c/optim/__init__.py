"""fairscale_c.optim — mirrors fairscale.optim (so far its gradient scalers; ShardedGradScaler
lives in fairscale_c.optim.grad_scaler, as in FairScale, and is not re-exported here)."""

from .grad_scaler import GradScaler
from .oss import OSS

__all__ = ["GradScaler", "OSS"]
from .adascale import AdaScale, AdaScaleWrapper  # noqa: E402

__all__ += ["AdaScale", "AdaScaleWrapper"]
