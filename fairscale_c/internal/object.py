"""Python objects as byte tensors (fairscale.internal.object), for sending them with collectives."""

from __future__ import annotations

import pickle
from typing import Any

import torch

__all__ = ["pyobject_to_tensor", "tensor_to_pyobject"]


def pyobject_to_tensor(obj: Any, fixed_buffer_size: int = 0) -> torch.Tensor:
    """`obj` pickled into a uint8 tensor, zero-padded to `fixed_buffer_size` bytes if given
    (ValueError if it does not fit)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    if fixed_buffer_size:
        pad = fixed_buffer_size - data.numel()
        if pad < 0:
            raise ValueError(
                f"message too big to send, increase `fixed_buffer_size`? - {data.numel()} > {fixed_buffer_size}"
            )
        if pad:
            data = torch.cat((data, torch.zeros(pad, dtype=torch.uint8)))
    return data


def tensor_to_pyobject(tensor: torch.Tensor) -> Any:
    """The object pyobject_to_tensor packed (trailing padding is ignored by pickle)."""
    return pickle.loads(tensor.cpu().numpy().tobytes())
