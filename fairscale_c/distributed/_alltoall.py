"""All-to-all where the engine does not run it itself.

The shared-memory engine and NCCL run ``all_to_all_single`` as one op (the engine's argument rules,
then a send and a recv with every peer and a copy of the rank's own block, issued together, so it
cannot deadlock). This module holds the rest: ``all_to_all`` (one tensor per rank) as one batch of
the same sends, recvs and copy, on any group; and ``all_to_all_single`` on the groups that have no
engine (one rank; CPU tensors of ranks on several hosts, through torch.distributed), checked by
the same C rules.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .. import _C


def check_single(
    output: Any,
    input: Any,
    output_split_sizes: Optional[Sequence[int]],
    input_split_sizes: Optional[Sequence[int]],
    rank: int,
    size: int,
) -> None:
    """The engine's rules for all_to_all_single(output, input, ...) on rank `rank` of a group of
    `size` (ValueError or TypeError naming the argument)."""
    _C.all_to_all_check(output, input, output_split_sizes, input_split_sizes, rank, size)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_lists(outputs: Sequence[Any], inputs: Sequence[Any], size: int, rank: int) -> None:
    """What the batch's own checks cannot name: the lists' lengths and which of their tensors
    break a rule."""
    op = "all_to_all"
    for name, ts in (("output_tensor_list", outputs), ("input_tensor_list", inputs)):
        if not isinstance(ts, (list, tuple)) or len(ts) != size:
            got = f"{len(ts)} items" if isinstance(ts, (list, tuple)) else type(ts).__name__
            raise ValueError(f"{op}: argument '{name}' must be a list of {size} tensors (one per rank), got {got}")
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: argument '{name}[{i}]' must be a torch.Tensor, got {type(t).__name__}")
    for i, o in enumerate(outputs):
        for j, t in enumerate(list(inputs) + list(outputs)):
            other = f"input_tensor_list[{j}]" if j < size else f"output_tensor_list[{j - size}]"
            if (j >= size and j - size == i) or not _overlap(o, t):
                continue
            raise ValueError(f"{op}: output_tensor_list[{i}] overlaps {other}; expected disjoint tensors")
    own_out, own_in = outputs[rank], inputs[rank]
    if own_out.numel() != own_in.numel():
        raise ValueError(
            f"{op}: output_tensor_list[{rank}] has {own_out.numel()} elements but input_tensor_list"
            f"[{rank}] (this rank's own block) has {own_in.numel()}; expected the same"
        )


def all_to_all(group: Any, outputs: Sequence[Any], inputs: Sequence[Any], async_op: bool = False) -> Any:
    """Rank j receives ``inputs[j]`` into its ``outputs[rank]``; one tensor per rank of the group in
    each list, ``outputs[i]`` as many elements as rank i sends. One batch: a send and a recv with
    every peer (empty tensors too, so a peer whose sizes disagree raises instead of leaving a
    message behind) and the copy of this rank's own block. Returns a Work when ``async_op``."""
    rank = group.rank
    _check_lists(outputs, inputs, group.size, rank)
    items = [("copy", outputs[rank], inputs[rank])]
    for peer in range(group.size):
        if peer != rank:
            items += [("send", inputs[peer], peer), ("recv", outputs[peer], peer)]
    return group.batch(items, async_op=async_op)


__all__ = ["all_to_all", "check_single"]
