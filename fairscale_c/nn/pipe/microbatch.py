"""Splitting a mini-batch into micro-batches and joining the outputs back.

A batch is a Tensor or a tuple of Tensors (the Pipe's input, every partition's output, and the
Pipe's output). Micro-batches are views along dimension 0, made by ``Tensor.chunk``, so a batch of
B rows in ``chunks`` pieces gives ceil(B / ceil(B / chunks)) micro-batches: an uneven last one, and
fewer than ``chunks`` when B is small (as FairScale does). The tensors of a tuple must agree on B
(FairScale pairs up their pieces whatever their sizes).
"""

from __future__ import annotations

from typing import List, Tuple, Union

import torch
from torch import Tensor

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]


def check(value: object, what: str = "input") -> None:
    """TypeError unless `value` is a Tensor or a tuple of Tensors."""
    if isinstance(value, Tensor):
        return
    if isinstance(value, tuple):
        for x in value:
            if not isinstance(x, Tensor):
                raise TypeError(f"expected Tensor, but got {type(x).__name__} (in the tuple given as {what})")
        return
    raise TypeError(f"expected Tensor, but got {type(value).__name__} (as {what}: a Tensor or a tuple of Tensors)")


def as_tuple(value: TensorOrTensors) -> Tensors:
    return (value,) if isinstance(value, Tensor) else tuple(value)


def from_tuple(values: Tensors, atomic: bool) -> TensorOrTensors:
    return values[0] if atomic else tuple(values)


def scatter(value: TensorOrTensors, chunks: int) -> List[Tensors]:
    """The micro-batches of `value`, each as a tuple of tensors."""
    tensors = as_tuple(value)
    if not tensors:
        raise TypeError("expected Tensor, but got an empty tuple (input: a Tensor or a tuple of Tensors)")
    sizes = [t.size(0) if t.dim() else None for t in tensors]
    if None not in sizes and len(set(sizes)) > 1:
        raise ValueError(
            f"the input's tensors must have the same size in dimension 0 to be split into micro-batches (sizes {sizes})"
        )
    pieces = [t.chunk(chunks) for t in tensors]
    count = len(pieces[0])
    if count == 1:  # the tensors themselves: a view from chunk() may not be modified in place
        return [tuple(tensors)]
    return [tuple(p[i] for p in pieces) for i in range(count)]


def gather(micro_batches: List[Tensors]) -> Tensors:
    """Concatenate the outputs of the micro-batches along dimension 0."""
    if len(micro_batches) == 1:
        return micro_batches[0]
    return tuple(torch.cat(parts) for parts in zip(*micro_batches))
