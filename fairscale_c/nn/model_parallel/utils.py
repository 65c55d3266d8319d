"""Size helpers of fairscale.nn.model_parallel.utils: divisibility checks, splitting a tensor along
its last dimension, and the vocabulary range a model-parallel rank holds."""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["ensure_divisibility", "divide_and_check_no_remainder", "split_tensor_along_last_dim", "VocabUtility"]


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """ValueError unless `denominator` divides `numerator`."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide_and_check_no_remainder(numerator: int, denominator: int) -> int:
    """numerator // denominator, after checking that it divides exactly."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def check_ids_in_range(ids: torch.Tensor, n: int, what: str) -> None:
    """IndexError unless every id is in [0, n), as nn.Embedding and F.cross_entropy raise: on the
    host for CPU tensors, as a device-side assertion (no synchronisation) for CUDA ones."""
    if ids.device.type == "cpu":
        bad = (ids < 0) | (ids >= n)
        if bool(bad.any()):
            raise IndexError(f"{what}: index {int(ids[bad][0])} out of range for a vocabulary of {n}")
    else:
        torch._assert_async(((ids >= 0) & (ids < n)).all(), f"{what}: index out of range")


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Tuple[torch.Tensor, ...]:
    """`tensor` split into `num_partitions` equal views along its last dimension (contiguous copies
    with `contiguous_split_chunks`)."""
    size = divide_and_check_no_remainder(tensor.shape[-1], num_partitions)
    chunks = torch.split(tensor, size, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


class VocabUtility:
    """The range [first, last) of vocabulary ids that model-parallel `rank` holds."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> Tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
        per_partition = divide_and_check_no_remainder(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
