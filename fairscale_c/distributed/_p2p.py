"""Point-to-point ops as :meth:`Group.batch` takes them: :class:`P2POp` (torch.distributed's
shape), message tags, and a batch's items as tuples."""

from __future__ import annotations

import operator
from typing import Any

_TAG_MIN, _TAG_MAX = -(2**31), 2**31 - 1


def check_tag(tag: Any, op: str) -> int:
    """A send / recv's message tag as an int: TypeError unless it is an int (``operator.index``),
    ValueError unless it fits a 32-bit signed int (torch's range). The C binding applies the same
    rule to what reaches it directly (csrc/py/args.c, fsc_py_parse_tag)."""
    try:
        value = operator.index(tag)
    except TypeError:
        raise TypeError(f"{op}: argument 'tag' must be an int, got {type(tag).__name__}") from None
    if not _TAG_MIN <= value <= _TAG_MAX:
        raise ValueError(f"{op}: argument 'tag' must fit a 32-bit signed int ({_TAG_MIN} to {_TAG_MAX}), got {tag!r}")
    return value


def batch_items(ops: Any) -> list:
    """A batch's ops as tuples (name, *args); TypeError naming what was given otherwise."""
    try:
        return [op.as_tuple() if isinstance(op, P2POp) else tuple(op) for op in ops]
    except TypeError:
        raise TypeError(
            f"batch: argument 'ops' must be a sequence of P2POp or tuples (name, *args), got {type(ops).__name__}"
        ) from None


def item_tag(item: tuple) -> int:
    """The tag of a batch's ("send" | "recv", tensor, peer[, tag]) tuple."""
    return check_tag(item[3], item[0]) if len(item) > 3 else 0


class P2POp:
    """One send or recv of a :meth:`Group.batch`, as ``torch.distributed.P2POp``: ``op`` is
    ``"send"`` / ``"recv"`` or one of this module's send / recv / isend / irecv functions (or
    torch.distributed's), ``peer`` a rank of the group the batch runs on, ``tag`` the message's
    tag (an int32; see :meth:`Group.recv` for how tags match; CUDA tensors take ``tag=0`` only)."""

    __slots__ = ("op", "tensor", "peer", "tag")

    def __init__(self, op: Any, tensor: Any, peer: int, group: Any = None, tag: int = 0) -> None:
        name = op if isinstance(op, str) else getattr(op, "__name__", "")
        name = {"isend": "send", "irecv": "recv"}.get(name, name)
        if name not in ("send", "recv"):
            raise ValueError(f"P2POp: argument 'op' must be 'send', 'recv' or a send/recv function, got {op!r}")
        if group is not None:
            raise ValueError("P2POp: argument 'group' is not supported; pass the group to batch()")
        self.op, self.tensor, self.peer, self.tag = name, tensor, int(peer), check_tag(tag, "P2POp")

    def as_tuple(self) -> tuple:
        return (self.op, self.tensor, self.peer, self.tag)


__all__ = ["P2POp", "batch_items", "check_tag", "item_tag"]
