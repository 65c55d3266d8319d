"""Balance helpers (mirrors fairscale.nn.pipe.balance): a `balance` for Pipe from per-layer costs.

::

    from fairscale_c.nn import Pipe
    from fairscale_c.nn.pipe.balance import balance_by_time

    balance = balance_by_time(2, model, torch.empty(128, 3, 224, 224), device="cpu")
    pipe = Pipe(model, balance, devices=["cpu", "cpu"], chunks=8)

Both profile copies of the layers (the model is not moved and gets no gradients). They cannot
profile a layer that works in place on its input (such as ``ReLU(inplace=True)``) at a partition
boundary, since each layer's input is a fresh leaf.
"""

from __future__ import annotations

from typing import List, Union

import torch
from torch import nn

from . import blockpartition
from .profile import profile_sizes, profile_times
from ..microbatch import TensorOrTensors
from ....internal.args import as_int

__all__ = ["balance_by_time", "balance_by_size"]

Device = Union[torch.device, int, str]
_CUDA = torch.device("cuda")  # FairScale's default profiling device


def _check(partitions: int, module: nn.Sequential) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be nn.Sequential to be partitioned, got {type(module).__name__}")
    if as_int(partitions) is None or partitions < 1:
        raise ValueError(f"partitions must be a positive integer, got {partitions!r}")


def _balance_cost(costs: List[int], partitions: int) -> List[int]:
    return [len(block) for block in blockpartition.solve(costs, partitions)]


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: TensorOrTensors,
    *,
    timeout: float = 1.0,
    device: Device = _CUDA,
) -> List[int]:
    """Layers per partition, balancing each layer's measured forward + backward time.

    sample: an input mini-batch (any batch size); device: where the layers are profiled
    ("cpu" or a CUDA device); timeout: profiling repeats until this many seconds have passed.
    """
    _check(partitions, module)
    times = profile_times(module, sample, timeout, torch.device(device))
    return _balance_cost(times, partitions)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: TensorOrTensors,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device = _CUDA,
) -> List[int]:
    """Layers per partition, balancing each layer's training memory: activations of one
    micro-batch of `input` split in `chunks`, plus `param_scale` copies of its parameters
    (2 for SGD, about 4 for Adam: gradients and optimizer state).

    On CUDA the activations are measured with the allocator's statistics, as FairScale does; on
    CPU (where FairScale raises) by the bytes autograd saves for backward plus the outputs.
    """
    _check(partitions, module)
    sizes = profile_sizes(module, input, chunks, param_scale, torch.device(device))
    return _balance_cost(sizes, partitions)
