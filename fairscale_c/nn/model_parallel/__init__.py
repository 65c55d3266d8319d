"""fairscale_c.nn.model_parallel — mirrors fairscale.nn.model_parallel: Megatron-style tensor
parallelism (column- and row-parallel linear layers, vocabulary- and embedding-parallel
embeddings, vocabulary-parallel cross-entropy) over model-parallel groups, on CPU ranks (the
shared-memory engine) and CUDA ones (NCCL). See docs/model_parallel.md."""

from .cross_entropy import vocab_parallel_cross_entropy
from .initialize import (
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
    get_pipeline_parallel_group,
    get_pipeline_parallel_ranks,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from .layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
    scatter_to_model_parallel_region,
)
from .random import checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed

__all__ = [
    "vocab_parallel_cross_entropy",
    "destroy_model_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_src_rank",
    "get_model_parallel_world_size",
    "get_pipeline_parallel_group",
    "get_pipeline_parallel_ranks",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "ColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_model_parallel_region",
    "gather_from_model_parallel_region",
    "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region",
    "checkpoint",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
]
