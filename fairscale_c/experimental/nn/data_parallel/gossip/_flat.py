"""A module's parameters of one dtype kept as views of one 1-D buffer, so that averaging them,
gossiping them or stepping their slow momentum is one op on the buffer, with no copy in and out.

On CPU ranks of one host the buffer is a shared tensor of the group (every rank maps it), on
which the engine's large collectives copy straight between the ranks. The parameters stay the
same Parameter objects (optimizers built before the wrapper keep working); only their storage
moves into the buffer. Something that later gives a parameter new storage (``module.half()``,
``.to(device)``) breaks the views: :meth:`FlatParams.intact` tells, and callers fall back to
flattening copies."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .....distributed import shared_zeros


class FlatParams:
    """Parameters ``params`` (one dtype and device, in order) as views of ``flat``, whose first
    ``total`` elements they cover; ``length`` >= total elements are allocated (the rest zeros)."""

    def __init__(self, params: List[torch.Tensor], length: int, group: Any) -> None:
        self.params = params
        self.total = sum(p.numel() for p in params)
        first = params[0]
        self.flat = shared_zeros(max(length, self.total), dtype=first.dtype, device=first.device, group=group)
        offset = 0
        with torch.no_grad():
            for p in params:
                view = self.flat[offset : offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                offset += p.numel()
        self._ptrs = [p.data_ptr() for p in params]

    @property
    def used(self) -> torch.Tensor:
        """The elements the parameters cover."""
        return self.flat[: self.total]

    def intact(self) -> bool:
        """Whether every parameter still lives at its place in the buffer."""
        return [p.data_ptr() for p in self.params] == self._ptrs and all(p.is_contiguous() for p in self.params)


def flatten_module(
    params: List[torch.Tensor], group: Any, padded: Dict[torch.dtype, int]
) -> Optional[List[FlatParams]]:
    """One FlatParams per dtype of ``params`` (in order of first appearance), or None where they
    span devices or one is not contiguous. ``padded``: dtype -> length to allocate (at least the
    dtype's total). A collective on CPU ranks: every rank calls it for the same model."""
    if not params or any(p.device != params[0].device or not p.is_contiguous() for p in params):
        return None
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return [FlatParams(ps, padded.get(dtype, 0), group) for dtype, ps in by_dtype.items()]
