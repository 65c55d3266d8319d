"""Parameter helpers of fairscale.internal.params."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from math import inf
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

__all__ = ["Workhandle", "get_global_rank", "recursive_copy_to_device", "calc_grad_norm"]


@dataclass
class Workhandle:
    handle: Any
    callback: Optional[Callable] = None


def get_global_rank(group: Any, rank: int) -> int:
    """The global rank of `rank` of `group`."""
    if group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def recursive_copy_to_device(value: Any, non_blocking: bool, device: torch.device) -> Any:
    """Copies of the tensors in nested lists, tuples and mappings on `device` (a mapping becomes a
    dict); other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, (list, tuple)):
        items = [recursive_copy_to_device(v, non_blocking=non_blocking, device=device) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, abc.Mapping):
        return {k: recursive_copy_to_device(v, non_blocking=non_blocking, device=device) for k, v in value.items()}
    return value


def calc_grad_norm(parameters: List[torch.nn.Parameter], p: float) -> torch.Tensor:
    """The p-norm of all the gradients together (parameters without one are left out; 0 if none),
    computed in float32 and returned in the first parameter's dtype."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    with_grad = [q for q in parameters if q.grad is not None]
    if not with_grad:
        return torch.tensor(0.0)
    p = float(p)
    if p == inf:
        return max(q.grad.detach().abs().max() for q in with_grad)  # type: ignore[union-attr]
    norms = torch.stack([torch.norm(q.grad.detach(), p, dtype=torch.float32) for q in with_grad])  # type: ignore[union-attr]
    return torch.norm(norms, p).to(dtype=with_grad[0].dtype)
