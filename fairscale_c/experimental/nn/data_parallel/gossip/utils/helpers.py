"""Flattening tensors of one dtype into one buffer and back, grouping by dtype, running one
communication op per dtype over a list of tensors, the gossip logger, and process groups whose
engine group is built when they are."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ......distributed import group_for


def flatten_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new 1-D tensor holding ``tensors`` (one dtype and device) one after another."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("flatten_tensors: argument 'tensors' is empty; expected at least one tensor")
    if len(tensors) == 1:
        return tensors[0].reshape(-1).clone()
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_tensors(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors``, in order (the inverse of :func:`flatten_tensors`)."""
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() < total:
        raise ValueError(
            f"unflatten_tensors: argument 'flat' must be 1-D with at least {total} elements, "
            f"got shape {tuple(flat.shape)}"
        )
    out, offset = [], 0
    for t in tensors:
        out.append(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()
    return out


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> Dict[torch.dtype, List[torch.Tensor]]:
    """dtype -> the tensors of that dtype, in their order (dtypes in order of first appearance)."""
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def as_flat(tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, bool]:
    """(one 1-D tensor holding ``tensors``, whether it is a copy): a single contiguous 1-D tensor
    is its own flat form."""
    if len(tensors) == 1 and tensors[0].dim() == 1 and tensors[0].is_contiguous():
        return tensors[0], False
    return flatten_tensors(tensors), True


def communicate(
    tensors: Sequence[torch.Tensor], communication_op: Callable[..., Any], logger: Optional[logging.Logger] = None
) -> None:
    """Run ``communication_op(tensor=flat)`` once per dtype on the flattened ``tensors`` (for
    instance ``functools.partial(torch.distributed.all_reduce, group=g)``); the result ends up in
    ``tensors`` (copied back where flattening copied)."""
    for same in group_by_dtype(tensors).values():
        flat, copied = as_flat(same)
        communication_op(tensor=flat)
        if logger is not None:
            logger.debug("communicated %d tensors of %s", len(same), flat.dtype)
        if copied:
            with torch.no_grad():
                torch._foreach_copy_(same, unflatten_tensors(flat, same))


_CONFIGURED: Set[str] = set()


def make_logger(rank: int, verbose: bool = True) -> logging.Logger:
    """The gossip logger, writing "<rank>: LEVEL -- thread -- message" lines to stdout (set up once
    per process), at DEBUG level with ``verbose`` and INFO otherwise."""
    logger = logging.getLogger(__name__)
    if logger.name not in _CONFIGURED:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(f"{rank}: %(levelname)s -- %(threadName)s -- %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)
        _CONFIGURED.add(logger.name)
    return logger


def create_process_group(ranks: Sequence[int]) -> Any:
    """``torch.distributed.new_group(ranks)`` (every rank of the default group calls it); on its
    members the group's collectives engine is set up now, so its first op is not a hidden
    rendezvous."""
    ranks = [int(r) for r in ranks]
    group = dist.new_group(ranks=ranks)
    if dist.get_rank() in ranks:
        group_for(group)
    return group


class MultiProcessAdapter(logging.LoggerAdapter):
    """Prefixes each message with "process: <n>" (``extra={"process_num": n}``, or a
    ``process_num`` keyword on the call)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        num = kwargs.pop("process_num", (self.extra or {}).get("process_num"))
        return f"process: {num} {msg}", kwargs
