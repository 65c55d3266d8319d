"""The model-parallel, data-parallel and pipeline groups of fairscale.nn.model_parallel.initialize.

``initialize_model_parallel(m, p)`` splits the world's ranks into a grid (data, pipeline, model)
of shape (world / (m p), p, m), ranks in row-major order: consecutive ranks form a model-parallel
group (put them on one host). Every rank builds every group, in the same order, through
``torch.distributed.new_group``; the getters return torch process groups, as FairScale's do. The
layers here run their collectives on them through fairscale_c.distributed (the shared-memory
engine for CPU tensors, NCCL for CUDA ones).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed
from ...internal.args import as_int


__all__ = [
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "get_model_parallel_group",
    "get_data_parallel_group",
    "get_pipeline_parallel_group",
    "get_pipeline_parallel_ranks",
    "get_model_parallel_world_size",
    "get_model_parallel_rank",
    "get_model_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "destroy_model_parallel",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Groups:
    model: "torch.distributed.ProcessGroup"
    data: "torch.distributed.ProcessGroup"
    pipeline: "torch.distributed.ProcessGroup"
    pipeline_ranks: List[int]


_groups: Optional[_Groups] = None


def _positive_int(value: object, name: str) -> int:
    if as_int(value) is None or value < 1:
        raise ValueError(f"initialize_model_parallel: argument '{name}' must be an int >= 1, got {value!r}")
    return as_int(value)


def initialize_model_parallel(
    model_parallel_size_: int,
    pipeline_length: int = 1,
    *,
    model_parallel_backend: Optional[str] = None,
    pipeline_backend: Optional[str] = None,
    ddp_backend: Optional[str] = None,
) -> None:
    """Build the groups: with 8 ranks and model_parallel_size_=2, model-parallel groups [0, 1],
    [2, 3], [4, 5], [6, 7] and data-parallel groups [0, 2, 4, 6], [1, 3, 5, 7]. A model-parallel
    size above the world size is taken as the world size (as FairScale does). Every rank calls it."""
    global _groups
    dist = torch.distributed  # looked up at the call, so that tests can stand a mock in for it
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel: torch.distributed is not initialised (init_process_group)")
    if _groups is not None:
        raise RuntimeError("initialize_model_parallel: already initialised; call destroy_model_parallel() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = min(_positive_int(model_parallel_size_, "model_parallel_size_"), world)
    pipeline = _positive_int(pipeline_length, "pipeline_length")
    if world % (model * pipeline):
        raise ValueError(
            f"initialize_model_parallel: the world size ({world}) must be a multiple of model_parallel_size_ "
            f"({model}) x pipeline_length ({pipeline})"
        )
    data = world // (model * pipeline)
    log.info("model parallel size %d, data parallel size %d, pipeline length %d", model, data, pipeline)
    grid = torch.arange(world).reshape(data, pipeline, model)
    i, j, k = (int(x[0]) for x in torch.where(grid == rank))

    mine = {}
    for jj in range(pipeline):
        for kk in range(model):
            g = dist.new_group(grid[:, jj, kk].tolist(), backend=ddp_backend)
            if (jj, kk) == (j, k):
                mine["data"] = g
    for ii in range(data):
        for jj in range(pipeline):
            g = dist.new_group(grid[ii, jj, :].tolist(), backend=model_parallel_backend)
            if (ii, jj) == (i, j):
                mine["model"] = g
    for ii in range(data):
        for kk in range(model):
            ranks = grid[ii, :, kk].tolist()
            g = dist.new_group(ranks, backend=pipeline_backend)
            if (ii, kk) == (i, k):
                mine["pipeline"], mine["pipeline_ranks"] = g, ranks
    _groups = _Groups(**mine)


def model_parallel_is_initialized() -> bool:
    """Whether initialize_model_parallel has run (and destroy_model_parallel not since)."""
    return _groups is not None


def _get() -> _Groups:
    if _groups is None:
        raise RuntimeError("model parallel is not initialised: call initialize_model_parallel() first")
    return _groups


def get_model_parallel_group() -> "torch.distributed.ProcessGroup":
    """The model-parallel group of this rank."""
    return _get().model


def get_data_parallel_group() -> "torch.distributed.ProcessGroup":
    """The data-parallel group of this rank."""
    return _get().data


def get_pipeline_parallel_group() -> "torch.distributed.ProcessGroup":
    """The pipeline group of this rank."""
    return _get().pipeline


def get_pipeline_parallel_ranks() -> List[int]:
    """The global ranks of this rank's pipeline group, in pipeline order."""
    return list(_get().pipeline_ranks)


def get_model_parallel_world_size() -> int:
    return torch.distributed.get_world_size(group=get_model_parallel_group())


def get_model_parallel_rank() -> int:
    return torch.distributed.get_rank(group=get_model_parallel_group())


def get_model_parallel_src_rank() -> int:
    """The global rank of model-parallel rank 0 in this rank's group."""
    size = get_model_parallel_world_size()
    return (torch.distributed.get_rank() // size) * size


def get_data_parallel_world_size() -> int:
    return torch.distributed.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return torch.distributed.get_rank(group=get_data_parallel_group())


def destroy_model_parallel() -> None:
    """Forget the groups (as FairScale, it does not destroy the torch process groups)."""
    global _groups
    _groups = None
