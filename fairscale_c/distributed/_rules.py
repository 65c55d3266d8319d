"""The engine's argument rules for the groups that run an op without the engine: a one-rank
:class:`LocalGroup`, and a group across hosts, whose CPU ops go through torch.distributed. They
refuse what the engine refuses, with the same messages (the engine's checks, csrc/comm/comm.c,
called through ``_C.check_calls``). Also: reduce ops given as torch.distributed.ReduceOp."""

from __future__ import annotations

from typing import Any, Optional

from .. import _C

_OPS = ("sum", "avg", "max", "min")


def redop(op: Any) -> Any:
    """``op`` as the engine's name: a str as it is (the engine checks it), a
    torch.distributed.ReduceOp of SUM, AVG, MAX or MIN as its lower-case name; any other ReduceOp
    is a ValueError naming the ops there are."""
    if op.__class__ is str:
        return op
    if isinstance(op, str):
        return str(op)
    import torch.distributed as dist

    if dist.is_available() and isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        for name in _OPS:
            if op == getattr(dist.ReduceOp, name.upper()):
                return name
        raise ValueError(f"op: expected one of {', '.join(repr(o) for o in _OPS)} or their ReduceOp, got {op!r}")
    raise TypeError(
        f"argument 'op' must be one of {', '.join(repr(o) for o in _OPS)} or their torch.distributed.ReduceOp, "
        f"got {type(op).__name__}"
    )


def _as_call(op: str, args: tuple, kwargs: dict) -> Optional[tuple]:
    """A single op's arguments as a batch tuple (``(name, *args)``), or None for an op whose
    rules are checked elsewhere (all_to_all_single) or that has none (barrier)."""
    if op == "all_gather":
        return ("all_gather", args[0], args[1])
    if op == "reduce_scatter":
        return ("reduce_scatter", args[0], args[1], kwargs["op"])
    if op == "all_reduce":
        return ("all_reduce", args[0], kwargs["op"])
    if op == "broadcast":
        return ("broadcast", args[0], kwargs["root"])
    if op == "reduce":
        return ("reduce", args[0], kwargs["op"], kwargs["root"])
    if op in ("send", "recv"):
        return (op, args[0], kwargs["dst" if op == "send" else "src"], kwargs.get("tag", 0))
    return None


_RANK_ARGS = {"broadcast": "root", "reduce": "root", "send": "dst", "recv": "src"}
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1


def _check_rank(op: str, kwargs: dict) -> None:
    """A single op's rank argument beyond a C int: the message of the engine's single-op methods
    (a batch item's would name the item)."""
    arg = _RANK_ARGS.get(op)
    value = kwargs.get(arg) if arg else None
    if isinstance(value, int) and not _INT_MIN <= value <= _INT_MAX:
        raise ValueError(f"{op}: {arg}={value!r} is not a valid group rank")


def check(op: str, args: tuple, kwargs: dict, rank: int, size: int) -> None:
    """Raise what the engine would raise for ``op`` (a Group method's name) with these arguments
    on rank ``rank`` of ``size``."""
    if op == "batch":
        _C.check_calls(args[0], rank, size)
        return
    call = _as_call(op, args, kwargs)
    if call is not None:
        _check_rank(op, kwargs)
        _C.check_calls([call], rank, size)


__all__ = ["check", "redop"]
