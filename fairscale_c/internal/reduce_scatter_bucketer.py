"""ReduceScatterBucketer of fairscale.internal.reduce_scatter_bucketer: many small reduce-scatters
packed into few large ones, on fairscale_c.distributed's engine (CPU tensors on the shared-memory
engine, CUDA tensors on NCCL).

::

    bucketer = ReduceScatterBucketer(bucket_cap_mb=25)
    bucketer.reduce_scatter_async(small_tensors, group, callback_fn=use)  # one tensor per rank
    bucketer.reduce_scatter_async(big_tensors, group, callback_fn=use)    # too big: reduced now
    bucketer.flush()  # every callback has run after this, with the sum of this rank's block

A bucket per (dtype, device, group) holds ``bucket_cap_mb`` MiB: a (world, cap / world) buffer
whose row r collects the inputs destined for rank r. FSDP here buckets in its own way; this class
is for code written against FairScale's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import distributed as fdist

__all__ = ["Bucket", "ReduceScatterBucketer"]


def _reduce_scatter(output: Tensor, stacked: Tensor, group: Any) -> None:
    """output = sum over ranks of row `rank` of each rank's (world, n) `stacked`."""
    fdist.group_for(group).reduce_scatter(output.view(-1), stacked.reshape(-1))


class Bucket:
    """The (world, shard) buffer of one (dtype, device, group), its fill and the callbacks waiting
    for its reduction."""

    def __init__(self, data: Tensor, group: Any) -> None:
        self.data = data
        self.group = group
        self.offset = 0
        self.callbacks: List[Callable[[], None]] = []
        self.output_shard = torch.zeros_like(data[0])

    def flush(self) -> None:
        """Reduce-scatter what the bucket holds, run its callbacks, and empty it."""
        if self.offset == 0:
            return
        _reduce_scatter(self.output_shard[: self.offset], self.data[:, : self.offset].contiguous(), self.group)
        for callback in self.callbacks:
            callback()
        self.data[:, : self.offset].zero_()
        self.offset = 0
        self.callbacks.clear()
        self.output_shard = torch.zeros_like(self.data[0])

    def setup(self) -> None:
        """Allocate the buffers again after teardown()."""
        for t in (self.data, self.output_shard):
            if t.untyped_storage().size() == 0:
                t.untyped_storage().resize_(t.numel() * t.element_size())

    def teardown(self) -> None:
        """Free the buffers (the bucket must be empty)."""
        if self.offset or self.callbacks:
            raise RuntimeError("Bucket.teardown: the bucket holds unreduced data; flush() first")
        for t in (self.data, self.output_shard):
            t.untyped_storage().resize_(0)


class ReduceScatterBucketer:
    """Buckets reduce-scatters of small tensors; ``bucket_cap_mb <= 0`` reduces each at once."""

    def __init__(self, bucket_cap_mb: int = 25) -> None:
        self.bucket_cap_mb = bucket_cap_mb
        self.buckets: Dict[Tuple[torch.dtype, torch.device, Any], Bucket] = {}

    @torch.no_grad()
    def reduce_scatter_async(
        self, input_list: List[Tensor], group: Any, callback_fn: Optional[Callable[[Tensor], Any]] = None
    ) -> None:
        """Reduce-scatter `input_list` (one tensor per rank of `group`, of one shape, dtype and
        device): `callback_fn` gets the sum over ranks of their ``input_list[rank]``, at once for an
        input larger than a bucket's share, else when its bucket is flushed (by a later input that
        does not fit, or by flush())."""
        world = group.size()
        if len(input_list) != world:
            raise ValueError(
                f"reduce_scatter_async: argument 'input_list' has {len(input_list)} tensors, expected group.size() "
                f"({world})"
            )
        first = input_list[0]
        if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in input_list):
            raise ValueError("reduce_scatter_async: the tensors of 'input_list' must share one shape, dtype and device")
        n = first.numel()
        if n > self._get_shard_size(first.element_size(), world):
            output = torch.zeros_like(first)
            _reduce_scatter(output, torch.stack(input_list).view(world, n), group)
            if callback_fn is not None:
                callback_fn(output)
            return
        bucket = self._get_bucket(first, group)
        if n > bucket.data.shape[1] - bucket.offset:
            bucket.flush()
        offset = bucket.offset
        bucket.data[:, offset : offset + n].copy_(torch.stack(input_list).view(world, n))
        bucket.offset += n
        if callback_fn is not None:
            result = bucket.output_shard[offset : offset + n].view_as(first)
            bucket.callbacks.append(functools.partial(callback_fn, result))

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce-scatter every partly filled bucket (every rank calls it)."""
        for bucket in self.buckets.values():
            bucket.flush()

    @torch.no_grad()
    def teardown(self) -> None:
        """Free every bucket's buffers."""
        for bucket in self.buckets.values():
            bucket.teardown()

    def _get_shard_size(self, element_size: int, num_shards: int) -> int:
        if self.bucket_cap_mb <= 0:
            return 0
        return int(self.bucket_cap_mb * 1024 * 1024 / element_size // num_shards)

    def _get_bucket(self, tensor: Tensor, group: Any) -> Bucket:
        key = (tensor.dtype, tensor.device, group)
        if key not in self.buckets:
            world = group.size()
            shard = self._get_shard_size(tensor.element_size(), world)
            data = tensor.new_zeros((world, shard))
            self.buckets[key] = Bucket(data, group)
        self.buckets[key].setup()
        return self.buckets[key]
