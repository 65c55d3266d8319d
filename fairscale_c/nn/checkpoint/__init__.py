"""fairscale_c.nn.checkpoint — mirrors fairscale.nn.checkpoint."""

from .checkpoint_activations import checkpoint_wrapper, is_checkpointing, is_recomputing

__all__ = ["checkpoint_wrapper", "is_checkpointing", "is_recomputing"]
