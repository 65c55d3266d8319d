"""Megatron-style model-parallel layers of fairscale.nn.model_parallel.layers.

Each layer holds its rank's slice of the full ("master") weight; building it initialises the
full weight on every rank with ``init_method`` (seed the ranks alike first) and keeps the slice.

- ColumnParallelLinear: Y = X A^T + b with A's rows (output features) split over the ranks; the
  output is gathered (``gather_output=True``) or left split.
- RowParallelLinear: A's columns (input features) split; the input is split (or already split,
  ``input_is_parallel=True``), the partial products are summed over the ranks, then b is added.
- VocabParallelEmbedding: the vocabulary split; each rank looks up the ids it holds (zeros for
  the others) and the lookups are summed over the ranks.
- ParallelEmbedding: the embedding dimension split; the lookups are gathered.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
import torch.nn.init as init
from torch.nn.parameter import Parameter

from .initialize import get_model_parallel_rank, get_model_parallel_world_size
from .mappings import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
    scatter_to_model_parallel_region,
)
from ...internal.args import as_int
from .utils import VocabUtility, check_ids_in_range, divide_and_check_no_remainder

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelEmbedding"]

Init = Callable[[torch.Tensor], torch.Tensor]


def _per_rank(value: Any, world: int, layer: str, name: str) -> int:
    """``value // world`` for a size argument of ``layer``: a positive int that the model-parallel
    world size divides, else a TypeError / ValueError naming the argument."""
    n = as_int(value)
    if n is None:
        raise TypeError(f"{layer}: argument '{name}' must be an int, got {type(value).__name__}")
    if n <= 0 or n % world:
        raise ValueError(
            f"{layer}: argument '{name}'={n} must be a positive multiple of the model-parallel world size ({world})"
        )
    return n // world


def _initialize_affine_weight(
    weight: torch.Tensor,
    out_features: int,
    in_features: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Init,
    stride: int = 1,
    return_master_weight: bool = False,
) -> Optional[torch.Tensor]:
    """Initialise the full (out_features, in_features) weight with `init_method` and copy this
    rank's part into `weight`: blocks of ``per_partition_size / stride`` along `partition_dim`,
    dealt round-robin to the ranks. Returns the full weight if asked."""
    world = get_model_parallel_world_size()
    if world == 1:
        init_method(weight)
        return weight if return_master_weight else None
    master = torch.empty(out_features, in_features, dtype=weight.dtype, requires_grad=False)
    init_method(master)
    block = divide_and_check_no_remainder(per_partition_size, stride)
    mine = torch.split(master, block, dim=partition_dim)[get_model_parallel_rank() :: world]
    with torch.no_grad():
        weight.copy_(torch.cat(mine, dim=partition_dim))
    return master if return_master_weight else None


def _linear_parameters(
    layer: torch.nn.Module, split_dim: int, per_partition: int, bias: bool, init_method: Init, stride: int, keep: bool
) -> None:
    """A parallel linear layer's weight (its part of the (out, in) weight along `split_dim`), its
    bias (zeros; split with the output features, whole when the input features are split) and
    ``master_weight``."""
    shape = [layer.out_features, layer.in_features]
    shape[split_dim] = per_partition
    layer.weight = Parameter(torch.empty(*shape))
    if bias:
        layer.bias = Parameter(torch.zeros(shape[0]))
    else:
        layer.register_parameter("bias", None)
    layer.master_weight = _initialize_affine_weight(
        layer.weight,
        layer.out_features,
        layer.in_features,
        per_partition,
        split_dim,
        init_method,
        stride=stride,
        return_master_weight=keep,
    )


class VocabParallelEmbedding(torch.nn.Module):
    """nn.Embedding with the vocabulary split over the model-parallel ranks (same arguments as
    torch.nn.Embedding's, plus ``init_method``)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: Init = init.xavier_normal_,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self._weight = None
        _per_rank(num_embeddings, get_model_parallel_world_size(), "VocabParallelEmbedding", "num_embeddings")
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, get_model_parallel_rank(), get_model_parallel_world_size()
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        _initialize_affine_weight(
            self.weight, num_embeddings, embedding_dim, self.num_embeddings_per_partition, 0, init_method
        )
        # padding_idx is a global id: on the rank whose rows hold it, its local row (no gradient)
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(
                f"VocabParallelEmbedding: padding_idx={padding_idx} must be within num_embeddings={num_embeddings}"
            )
        pad = None if padding_idx is None else padding_idx % num_embeddings
        inside = pad is not None and self.vocab_start_index <= pad < self.vocab_end_index
        self._local_padding_idx = pad - self.vocab_start_index if inside else None

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        check_ids_in_range(input_, self.num_embeddings, "VocabParallelEmbedding")
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(
            local_ids,
            self.weight,
            self._local_padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_model_parallel_region(out)


class ParallelEmbedding(torch.nn.Module):
    """nn.Embedding with the embedding dimension split over the model-parallel ranks."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: Init = init.xavier_normal_,
        keep_master_weight_for_test: bool = False,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self._weight = None
        world = get_model_parallel_world_size()
        self.embedding_dim_per_partition = _per_rank(embedding_dim, world, "ParallelEmbedding", "embedding_dim")
        self.weight = Parameter(torch.empty(num_embeddings, self.embedding_dim_per_partition))
        _initialize_affine_weight(
            self.weight, num_embeddings, embedding_dim, self.embedding_dim_per_partition, 1, init_method
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        input_parallel = copy_to_model_parallel_region(input_)
        out = F.embedding(
            input_parallel,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        return gather_from_model_parallel_region(out)


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A's output features split over the model-parallel ranks.

    Args:
        in_features, out_features, bias: as nn.Linear's (the bias, split too, starts at zero).
        gather_output: gather Y on every rank (else each keeps its slice Y_i = X A_i^T + b_i).
        init_method: initialises the full weight. stride: for strided (interleaved) splits.
        keep_master_weight_for_test: keep the full weight as ``master_weight``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        init_method: Init = init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        world = get_model_parallel_world_size()
        self.output_size_per_partition = _per_rank(out_features, world, "ColumnParallelLinear", "out_features")
        _linear_parameters(
            self, 0, self.output_size_per_partition, bias, init_method, stride, keep_master_weight_for_test
        )

    def get_master_weight(self) -> torch.Tensor:
        """The full weight, gathered from the ranks (every rank calls it)."""
        return gather_from_model_parallel_region(self.weight.data.transpose(0, 1)).transpose_(0, 1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = F.linear(copy_to_model_parallel_region(input_), self.weight, self.bias)
        return gather_from_model_parallel_region(out) if self.gather_output else out


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A's input features (and X's last dimension) split over the
    model-parallel ranks; the bias is not split and is added after the sum over ranks.

    Args:
        in_features, out_features, bias: as nn.Linear's (the bias starts at zero).
        input_is_parallel: the input is already this rank's slice (e.g. a ColumnParallelLinear's
            output with ``gather_output=False``).
        init_method, stride, keep_master_weight_for_test: as ColumnParallelLinear's.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: Init = init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        world = get_model_parallel_world_size()
        self.input_size_per_partition = _per_rank(in_features, world, "RowParallelLinear", "in_features")
        _linear_parameters(
            self, 1, self.input_size_per_partition, bias, init_method, stride, keep_master_weight_for_test
        )

    def get_master_weight(self) -> torch.Tensor:
        """The full weight, gathered from the ranks (every rank calls it)."""
        return gather_from_model_parallel_region(self.weight.data)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        input_parallel = input_ if self.input_is_parallel else scatter_to_model_parallel_region(input_)
        out = reduce_from_model_parallel_region(F.linear(input_parallel, self.weight))
        return out + self.bias if self.bias is not None else out
