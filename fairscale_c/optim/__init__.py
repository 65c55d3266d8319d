"""fairscale_c.optim — mirrors fairscale.optim (OSS, AdaScale, Adam and its gradient scalers; ShardedGradScaler
lives in fairscale_c.optim.grad_scaler, as in FairScale, and is not re-exported here)."""

from .grad_scaler import GradScaler
from .oss import OSS

__all__ = ["GradScaler", "OSS"]
from .adascale import AdaScale, AdaScaleWrapper  # noqa: E402
from .adam import Adam, Precision  # noqa: E402

__all__ += ["AdaScale", "AdaScaleWrapper", "Adam", "Precision"]
