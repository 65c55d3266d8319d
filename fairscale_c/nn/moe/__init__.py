"""fairscale_c.nn.moe — mirrors fairscale.nn.moe: MOELayer and Top2Gate (docs/moe.md)."""

from .moe_layer import MOELayer
from .top2gate import Top2Gate

__all__ = ["MOELayer", "Top2Gate"]
