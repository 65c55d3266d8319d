"""Parameter helpers of fairscale.internal.params."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from math import inf
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from fairscale_c import _C

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


_C_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what _C.cpu_sq_norm reads


def _check_norm_type(p: float) -> float:
    p = float(p)
    if p == 0 or p != p:
        raise ValueError(
            f"clip_grad_norm: argument 'norm_type' must be a number other than 0, or inf or -inf, got {p} "
            "(torch's 0 counts the gradient tensors with a nonzero entry: not a norm to clip by)"
        )
    return p


def grad_norm_term(grads: Sequence[torch.Tensor], p: float, device: Optional[torch.device] = None) -> torch.Tensor:
    """One rank's term of the p-norm of gradients spread over ranks: the sum of |g|^p over its
    gradients, their largest |g| for p = inf or smallest for p = -inf (inf without gradients),
    in float64, shape (1,), on `device` (default: the first gradient's; the CPU without
    gradients). Summed (p = inf: maxed, -inf: minned) over the ranks by an all_reduce, its p-th
    root is the norm of all of them. Contiguous CPU gradients are reduced in C for p = 2 and inf
    (double accumulation); the others with torch's foreach norm on their own devices, without a
    host synchronisation."""
    p = _check_norm_type(p)
    is_inf, is_neg_inf = p == inf, p == -inf
    if device is None:
        device = grads[0].device if len(grads) else torch.device("cpu")
    in_c = is_inf or p == 2.0
    host: List[float] = []
    groups: Dict[Tuple[torch.device, bool], List[torch.Tensor]] = {}  # (device, float64) -> gradients
    for g in grads:
        if in_c and g.device.type == "cpu" and g.is_contiguous() and g.dtype in _C_NORM_DTYPES:
            host.append(_C.cpu_sq_norm(g, absmax=is_inf))
        else:
            groups.setdefault((g.device, g.dtype == torch.float64), []).append(g)

    def combine(t: torch.Tensor) -> torch.Tensor:
        return t.max() if is_inf else t.min() if is_neg_inf else t.sum()

    terms = []
    if host:  # through torch, whose max keeps a NaN wherever it is (Python's max depends on the order)
        terms.append(combine(torch.tensor(host, dtype=torch.float64)).reshape(1).to(device=device))
    for (_, wide), gs in groups.items():
        # float64 in its own precision (torch refuses to narrow it), the rest accumulated in float32
        norms = torch.stack(torch._foreach_norm(gs, p) if wide else torch._foreach_norm(gs, p, dtype=torch.float32))
        term = combine(norms) if is_inf or is_neg_inf else norms.double().pow(p).sum()
        terms.append(term.reshape(1).to(device=device, dtype=torch.float64))
    if not terms:
        return torch.full((1,), inf if is_neg_inf else 0.0, dtype=torch.float64, device=device)
    return combine(torch.cat(terms)).reshape(1)


def reduce_norm_term(comm: Any, term: torch.Tensor, p: float) -> torch.Tensor:
    """The norm of all ranks' gradients from each rank's `grad_norm_term`, by one all_reduce over
    `comm` (a 0-d tensor on the term's device, in its dtype). For p = inf and -inf the term travels
    with a NaN flag: NCCL's max and min drop a NaN, and a NaN gradient on any rank must give a NaN
    norm on every rank, as the norm of one process does."""
    p = float(p)
    if p not in (inf, -inf):
        comm.all_reduce(term, op="sum")
        return term[0] ** (1.0 / p)
    sign = 1.0 if p == inf else -1.0  # -inf: the minimum, and the flag negated, both by "min"
    both = torch.cat([term, sign * term.isnan().to(term.dtype)])
    comm.all_reduce(both, op="max" if p == inf else "min")
    return torch.where(both[1] != 0, torch.full_like(both[0], float("nan")), both[0])


def norm_dtype(grads: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype a total norm is returned in, as torch's clip_grad_norm_: float64 over float64
    gradients, float32 otherwise."""
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def calc_grad_norm(parameters: List[torch.nn.Parameter], p: float) -> torch.Tensor:
    """The p-norm of all the gradients together (parameters without one are left out; 0 if none),
    computed in float64 and returned in the first parameter's dtype."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    with_grad = [q for q in parameters if q.grad is not None]
    if not with_grad:
        return torch.tensor(0.0)
    p = float(p)
    term = grad_norm_term([q.grad.detach() for q in with_grad], p)[0]  # type: ignore[union-attr]
    return (term if p in (inf, -inf) else term ** (1.0 / p)).to(dtype=with_grad[0].dtype)
