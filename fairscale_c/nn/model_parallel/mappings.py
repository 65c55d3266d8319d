"""The autograd functions that move activations in and out of a model-parallel region
(fairscale.nn.model_parallel.mappings), on fairscale_c.distributed's collectives over the
model-parallel group:

- copy_to: identity forward; all-reduce (sum) of the gradient backward.
- reduce_from: all-reduce (sum) forward, in place on its input as in FairScale; identity backward.
- scatter_to: keep this rank's slice of the last dimension forward; all-gather backward.
- gather_from: all-gather along the last dimension forward; keep this rank's slice backward.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import distributed as fdist
from .initialize import get_model_parallel_group
from .utils import split_tensor_along_last_dim

__all__ = [
    "copy_to_model_parallel_region",
    "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region",
    "gather_from_model_parallel_region",
]


def _engine() -> Any:
    """The engine group of the model-parallel group (None with one rank: nothing to do)."""
    group = fdist.group_for(get_model_parallel_group())
    return None if group.size == 1 else group


def _reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum over the model-parallel ranks, in place on `input_` (returned)."""
    group = _engine()
    if group is None:
        return input_
    data = input_.detach()  # the engine takes tensors without autograd history; same storage
    if data.is_contiguous():
        group.all_reduce(data)
    else:
        summed = data.contiguous()
        group.all_reduce(summed)
        data.copy_(summed)
    return input_


def _split(input_: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the last dimension (contiguous)."""
    group = _engine()
    if group is None:
        return input_
    return split_tensor_along_last_dim(input_, group.size)[group.rank].contiguous()


def _gather(input_: torch.Tensor) -> torch.Tensor:
    """Every rank's `input_`, concatenated along the last dimension in rank order."""
    group = _engine()
    if group is None:
        return input_
    data = input_.detach().contiguous()
    out = torch.empty((group.size, *data.shape), dtype=data.dtype, device=data.device)
    group.all_gather(out, data)
    return torch.cat(out.unbind(0), dim=-1)


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return input_

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _reduce(grad_output.clone())  # the incoming gradient may be shared with other consumers


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mark_dirty(input_)
        return _reduce(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _split(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _gather(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _gather(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _split(grad_output)


def copy_to_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    return _GatherFromModelParallelRegion.apply(input_)
