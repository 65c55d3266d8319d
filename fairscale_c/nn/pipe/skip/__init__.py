"""fairscale_c.nn.pipe.skip — skip connections for Pipe (mirrors fairscale.nn.pipe.skip)."""

from .namespace import Namespace
from .skippable import pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace"]
