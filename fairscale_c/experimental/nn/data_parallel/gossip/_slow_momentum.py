"""SlowMo's slow momentum step over the optimizer's parameters, viewed as one flat float32 vector
cut into ``num_shards`` portions of equal length (the last one padded).

Memory-efficient mode: rank i < num_shards keeps the old parameters and the momentum of portion i
only; a step averages the ranks' parameters into each portion's owner (one reduce-scatter when
every rank owns a portion, else one reduce per portion), the owner steps its portion, and the
portions go back to every rank (an all-gather, else one broadcast per portion). Otherwise every
rank keeps and steps the whole vector, with no communication.

The update of a portion, per parameter group with learning rate lr, is FairScale's:
    momentum = slowmo_momentum * momentum - params / lr + old / lr
    old      = old - lr * slowmo_lr * momentum
    params   = old
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import torch


@dataclass
class Shard:
    """This rank's portion [start, end) of the flat parameter vector, and its state."""

    start: int
    end: int
    old_params: torch.Tensor  # (portion length,) float32: the parameters after the last slow step
    momentum: torch.Tensor  # (portion length,) float32


def optimizer_params(optimizer: torch.optim.Optimizer) -> Tuple[List[torch.Tensor], List[Tuple[int, int, float]]]:
    """The optimizer's parameters in group order, and each group's (start, end, lr) in the flat
    vector. Slow momentum runs in float32 on one device: anything else is a ValueError."""
    params: List[torch.Tensor] = []
    ranges: List[Tuple[int, int, float]] = []
    offset = 0
    for i, group in enumerate(optimizer.param_groups):
        start = offset
        for p in group["params"]:
            if p.dtype != torch.float32:
                raise ValueError(
                    f"SlowMoDistributedDataParallel: slow momentum needs float32 optimizer parameters, "
                    f"param group {i} holds a {p.dtype} one (give the optimizer the float32 master copies)"
                )
            if params and p.device != params[0].device:
                raise ValueError(
                    f"SlowMoDistributedDataParallel: slow momentum needs the optimizer's parameters on one "
                    f"device, got {params[0].device} and {p.device}"
                )
            params.append(p)
            offset += p.numel()
        ranges.append((start, offset, float(group["lr"])))
    if not params:
        raise ValueError("SlowMoDistributedDataParallel: the optimizer holds no parameters")
    return params, ranges


def flat_copy(params: List[torch.Tensor], length: int) -> torch.Tensor:
    """A new float32 vector of ``length`` elements starting with the parameters (zeros after)."""
    total = sum(p.numel() for p in params)
    flat = torch.empty(length, dtype=torch.float32, device=params[0].device)
    torch.cat([p.detach().reshape(-1) for p in params], out=flat[:total])
    flat[total:].zero_()
    return flat


def copy_back(params: List[torch.Tensor], flat: torch.Tensor) -> None:
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    torch._foreach_copy_([p.detach() for p in params], views)


def step_portion(
    shard: Shard, portion: torch.Tensor, ranges: List[Tuple[int, int, float]], momentum: float, slowmo_lr: float
) -> None:
    """The slow momentum update of ``portion`` (this rank's [start, end) of the flat parameters)."""
    for start, end, lr in ranges:
        lo, hi = max(start, shard.start), min(end, shard.end)
        if lo >= hi:
            continue
        a, b = lo - shard.start, hi - shard.start
        p, old, m = portion[a:b], shard.old_params[a:b], shard.momentum[a:b]
        m.mul_(momentum).sub_(p, alpha=1 / lr).add_(old, alpha=1 / lr)
        old.add_(m, alpha=-lr * slowmo_lr)
        p.copy_(old)


def average_into_owners(comm: Any, flat: torch.Tensor, rank: int, world: int, num_shards: int, length: int) -> Any:
    """Average the ranks' ``flat`` (num_shards * length elements) into each portion's owner:
    returns this rank's averaged portion (a new tensor or a view of ``flat``), or None."""
    flat.div_(world)
    if num_shards == world:
        mine = torch.empty(length, dtype=flat.dtype, device=flat.device)
        comm.reduce_scatter(mine, flat, op="sum")
        return mine
    works = [comm.reduce(flat[i * length : (i + 1) * length], root=i, async_op=True) for i in range(num_shards)]
    for w in works:
        w.wait()
    return flat[rank * length : (rank + 1) * length] if rank < num_shards else None


def send_back_from_owners(comm: Any, flat: torch.Tensor, mine: Any, world: int, num_shards: int, length: int) -> None:
    """Every rank's ``flat`` = the owners' portions (the inverse of :func:`average_into_owners`)."""
    if num_shards == world:
        comm.all_gather(flat, mine)
        return
    works = [comm.broadcast(flat[i * length : (i + 1) * length], root=i, async_op=True) for i in range(num_shards)]
    for w in works:
        w.wait()
