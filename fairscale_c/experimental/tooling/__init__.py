"""fairscale_c.experimental.tooling — mirrors fairscale.experimental.tooling: the layer by layer
memory tracker (``layer_memory_tracker``), for CUDA and CPU models (docs/experimental.md)."""

from typing import List

__all__: List[str] = []
