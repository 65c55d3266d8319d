"""All-to-all on any group, as one batch of sends and receives (so it cannot deadlock, on the
shared-memory engine and on NCCL alike) plus a local copy of the rank's own block.

``all_to_all_single(output, input)``: input's dim-0 block j goes to rank j; output's block i
comes from rank i (torch.distributed.all_to_all_single's meaning, split sizes included).
``all_to_all(outputs, inputs)``: the same with one tensor per rank.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from ._work import CompletedWork, local_copy


def _split_sizes(arg: Optional[Sequence[int]], argname: str, tensor: torch.Tensor, size: int, op: str) -> List[int]:
    rows = tensor.shape[0]
    if arg is None or len(arg) == 0:  # torch takes [] as "split evenly" too
        if rows % size:
            raise ValueError(
                f"{op}: {argname} is not given, so dim 0 of the tensor ({rows}) must divide evenly over the "
                f"group's {size} ranks"
            )
        return [rows // size] * size
    sizes = list(arg)
    if len(sizes) != size or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes):
        raise ValueError(
            f"{op}: argument '{argname}' must hold {size} ints >= 0 (one per rank of the group), got {list(arg)!r}"
        )
    if sum(sizes) != rows:
        raise ValueError(f"{op}: argument '{argname}' sums to {sum(sizes)}; expected dim 0 of the tensor ({rows})")
    return sizes


def _blocks(t: torch.Tensor, split_sizes: Optional[Sequence[int]], argname: str, size: int, op: str) -> tuple:
    """`t`'s dim-0 blocks, one per rank."""
    if not split_sizes and t.shape[0] % size == 0:  # equal blocks: one call makes every view
        return t.view(size, -1).unbind(0) if t.numel() else t.split(t.shape[0] // size)
    return t.split(_split_sizes(split_sizes, argname, t, size, op))


def _check_tensor(t: Any, argname: str, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{argname}' must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: argument '{argname}' must be contiguous")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_pair(output: torch.Tensor, input: torch.Tensor, out_name: str, in_name: str, op: str) -> None:
    if output.dtype != input.dtype:
        raise ValueError(f"{op}: {out_name} is {output.dtype} but {in_name} is {input.dtype}; expected the same dtype")
    if output.device.type != input.device.type:
        raise ValueError(
            f"{op}: {out_name} is on {output.device.type} but {in_name} is on {input.device.type}; "
            "expected the same device"
        )


def _run(group: Any, pairs: list, async_op: bool) -> Any:
    """pairs[j] = (output block from rank j, input block for rank j). Empty blocks are sent too (a
    header only), so a peer whose split sizes disagree with this rank's raises instead of leaving an
    unread message in the channel."""
    own_out, own_in = pairs[group.rank]
    if own_out.numel():
        local_copy(own_out, own_in)
    items = []
    for peer, (out, inp) in enumerate(pairs):
        if peer != group.rank:
            items += [("send", inp, peer), ("recv", out, peer)]
    if not items:  # a group of one rank
        return CompletedWork() if async_op else None
    return group.batch(items, async_op=async_op)


def all_to_all_single(
    group: Any,
    output: Any,
    input: Any,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    async_op: bool = False,
) -> Any:
    """Rank j receives input's dim-0 block j (``input_split_sizes[j]`` rows; equal blocks if not
    given) into its output block ``rank``; output's block i (``output_split_sizes[i]`` rows) comes
    from rank i. Tensors: contiguous, at least 1-D, one dtype, rows of the same number of
    elements, not overlapping. Returns a Work when ``async_op``."""
    op = "all_to_all_single"
    _check_tensor(output, "output", op)
    _check_tensor(input, "input", op)
    _check_pair(output, input, "output", "input", op)
    for name, t in (("output", output), ("input", input)):
        if t.dim() == 0:
            raise ValueError(f"{op}: argument '{name}' must have at least one dimension (blocks are split on dim 0)")
    out_rows, in_rows = output.shape[0], input.shape[0]
    out_row, in_row = output.numel() // out_rows if out_rows else None, input.numel() // in_rows if in_rows else None
    if out_row is not None and in_row is not None and out_row != in_row:
        raise ValueError(
            f"{op}: a row of output has {out_row} elements but a row of input has {in_row}; expected the same"
        )
    if _overlap(output, input):
        raise ValueError(f"{op}: output overlaps input; expected disjoint tensors")
    size, rank = group.size, group.rank
    outs = _blocks(output, output_split_sizes, "output_split_sizes", size, op)
    ins = _blocks(input, input_split_sizes, "input_split_sizes", size, op)
    if outs[rank].numel() != ins[rank].numel():
        raise ValueError(
            f"{op}: this rank's own block has {outs[rank].shape[0]} rows in output but {ins[rank].shape[0]} in "
            f"input (rank {rank} of the split sizes); expected the same"
        )
    return _run(group, list(zip(outs, ins)), async_op)


def all_to_all(group: Any, outputs: Sequence[Any], inputs: Sequence[Any], async_op: bool = False) -> Any:
    """Rank j receives ``inputs[j]`` into its ``outputs[rank]``; one tensor per rank of the group in
    each list, ``outputs[i]`` as many elements as rank i sends. Returns a Work when ``async_op``."""
    op = "all_to_all"
    size = group.size
    for name, ts in (("output_tensor_list", outputs), ("input_tensor_list", inputs)):
        if not isinstance(ts, (list, tuple)) or len(ts) != size:
            got = f"{len(ts)} items" if isinstance(ts, (list, tuple)) else type(ts).__name__
            raise ValueError(f"{op}: argument '{name}' must be a list of {size} tensors (one per rank), got {got}")
        for i, t in enumerate(ts):
            _check_tensor(t, f"{name}[{i}]", op)
    for i, (o, t) in enumerate(zip(outputs, inputs)):
        _check_pair(o, t, f"output_tensor_list[{i}]", f"input_tensor_list[{i}]", op)
    for i, o in enumerate(outputs):
        for j, t in enumerate(list(inputs) + list(outputs)):
            other = f"input_tensor_list[{j}]" if j < size else f"output_tensor_list[{j - size}]"
            if (j >= size and j - size == i) or not _overlap(o, t):
                continue
            raise ValueError(f"{op}: output_tensor_list[{i}] overlaps {other}; expected disjoint tensors")
    own_out, own_in = outputs[group.rank], inputs[group.rank]
    if own_out.numel() != own_in.numel():
        raise ValueError(
            f"{op}: output_tensor_list[{group.rank}] has {own_out.numel()} elements but input_tensor_list"
            f"[{group.rank}] (this rank's own block) has {own_in.numel()}; expected the same"
        )
    return _run(group, list(zip(outputs, inputs)), async_op)


__all__ = ["all_to_all", "all_to_all_single"]
