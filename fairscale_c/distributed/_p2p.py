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


def batch_items(ops: Any, group: Any = None) -> list:
    """A batch's ops as tuples (name, *args); TypeError naming what was given otherwise. A P2POp
    that names a group must name ``group`` (the group the batch runs on) or its process group."""
    try:
        ops = list(ops)
    except TypeError:
        raise TypeError(
            f"batch: argument 'ops' must be a sequence of P2POp or tuples (name, *args), got {type(ops).__name__}"
        ) from None
    items = []
    for i, op in enumerate(ops):
        if isinstance(op, P2POp):
            items.append(op.as_tuple())
        elif isinstance(op, (tuple, list)):
            items.append(tuple(op))
        else:
            raise TypeError(
                f"batch: ops[{i}] must be a fairscale_c.distributed.P2POp or a tuple (name, *args), got "
                f"{type(op).__module__}.{type(op).__name__}"
                + (" (build it with fairscale_c.distributed.P2POp)" if type(op).__name__ == "P2POp" else "")
            )
    if group is not None:
        for i, op in enumerate(ops):
            if isinstance(op, P2POp) and op.group is not None and op.group is not group:
                if op.group is not getattr(group, "process_group", None):
                    raise ValueError(
                        f"batch: ops[{i}] names group {op.group!r}, but the batch runs on {group!r}; "
                        "every P2POp of a batch must name its group or none"
                    )
    return items


def item_tag(item: tuple) -> int:
    """The tag of a batch's ("send" | "recv", tensor, peer[, tag]) tuple."""
    return check_tag(item[3], item[0]) if len(item) > 3 else 0


class P2POp:
    """One send or recv of a :meth:`Group.batch`, as ``torch.distributed.P2POp``: ``op`` is
    ``"send"`` / ``"recv"`` or one of fairscale_c.distributed's send / recv / isend / irecv
    functions (or torch.distributed's), ``peer`` a rank of the group the batch runs on (a global
    rank when :func:`batch_isend_irecv` runs it on a torch.distributed process group), ``group``
    that group (a fairscale_c.distributed group or a torch.distributed process group; None: the
    batch's), ``tag`` the message's tag (an int32; see :meth:`Group.recv` for how tags match; CUDA
    tensors take ``tag=0`` only)."""

    __slots__ = ("op", "tensor", "peer", "group", "tag")

    def __init__(self, op: Any, tensor: Any, peer: int, group: Any = None, tag: int = 0) -> None:
        name = op if isinstance(op, str) else getattr(op, "__name__", "")
        name = {"isend": "send", "irecv": "recv"}.get(name, name)
        if name not in ("send", "recv"):
            raise ValueError(f"P2POp: argument 'op' must be 'send', 'recv' or a send/recv function, got {op!r}")
        try:
            peer = operator.index(peer)
        except TypeError:
            raise TypeError(
                f"P2POp: argument 'peer' must be an int (a group rank), got {type(peer).__name__}"
            ) from None
        self.op, self.tensor, self.peer, self.group, self.tag = name, tensor, peer, group, check_tag(tag, "P2POp")

    def as_tuple(self) -> tuple:
        return (self.op, self.tensor, self.peer, self.tag)


__all__ = ["P2POp", "batch_items", "check_tag", "item_tag"]
