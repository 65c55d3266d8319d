"""fairscale_c.experimental.optim — mirrors fairscale.experimental.optim: DynamicLossScaler
(docs/experimental.md)."""

from .dynamic_loss_scaler import DynamicLossScaler

__all__ = ["DynamicLossScaler"]
