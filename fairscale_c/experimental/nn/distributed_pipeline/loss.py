"""A loss evaluated on the worker that holds the pipeline's output."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.distributed import rpc


def _rloss(loss_func: Callable[..., Any], input_rref: rpc.RRef, target_rref: rpc.RRef) -> Any:
    return loss_func(input_rref.to_here(), target_rref.to_here())


def _computed(rref: rpc.RRef) -> None:
    """On the loss's owner: return once its value exists (a local wait: no tensor travels)."""
    rref.to_here()


def DistributedLoss(loss: type, *args: Any, **kwargs: Any) -> Callable[[rpc.RRef, rpc.RRef], rpc.RRef]:
    """``loss(*args, **kwargs)`` (an nn.Module class, e.g. nn.MSELoss) as a function of two RRefs
    (the pipeline's output and the target) returning an RRef of the loss, computed on the worker
    that owns the output, once it is computed; ``rref.backward(context_id)`` then runs distributed
    autograd from it."""
    if not (isinstance(loss, type) and issubclass(loss, nn.Module)):
        raise TypeError(f"DistributedLoss: argument 'loss' must be an nn.Module class, got {loss!r}")
    loss_func = loss(*args, **kwargs)

    def dloss(input_rref: rpc.RRef, target_rref: rpc.RRef) -> rpc.RRef:
        rref = rpc.remote(input_rref.owner(), _rloss, args=(loss_func, input_rref, target_rref))
        # RRef.backward on a value not yet computed raises instead of waiting: wait here. Not by
        # fetching the loss, which inside a distributed autograd context records a send on its
        # owner that no gradient would ever come back to, so the owner's backward would wait for
        # one until the RPC timeout.
        rpc.rpc_sync(rref.owner(), _computed, args=(rref,))
        return rref

    return dloss
