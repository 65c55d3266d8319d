"""LocalGroup: the group of a single process, with the API of :class:`Group`."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .. import _C
from . import _alltoall, _rules
from ._group import Group
from ._p2p import batch_items, check_tag
from ._work import CompletedWork, local_copy


class LocalGroup:
    """The group of a single process (no torch.distributed, or a process group of one rank): every
    collective is a local copy or nothing, completed when it returns. Arguments follow the
    engine's rules (``_rules``), so code that breaks one fails here as it would on more ranks."""

    def __init__(self, pg: Any = None, name: str = "local") -> None:
        self.rank, self.size, self.name, self.process_group = 0, 1, name, pg

    def __repr__(self) -> str:
        return f"LocalGroup(name={self.name!r})"

    @staticmethod
    def _done(async_op: bool) -> Any:
        return CompletedWork() if async_op else None

    def all_gather(self, output: Any, input: Any, async_op: bool = False) -> Any:
        self._route("all_gather", ("output", output), ("input", input))
        _rules.check("all_gather", (output, input), {}, 0, 1)
        local_copy(output, input)
        return self._done(async_op)

    def reduce_scatter(self, output: Any, input: Any, op: str = "sum", async_op: bool = False) -> Any:
        self._route("reduce_scatter", ("output", output), ("input", input))
        _rules.check("reduce_scatter", (output, input), {"op": _rules.redop(op)}, 0, 1)
        local_copy(output, input)
        return self._done(async_op)

    def all_reduce(self, tensor: Any, op: str = "sum", async_op: bool = False) -> Any:
        self._route("all_reduce", ("tensor", tensor))
        _rules.check("all_reduce", (tensor,), {"op": _rules.redop(op)}, 0, 1)
        return self._done(async_op)

    def broadcast(self, tensor: Any, root: int = 0, async_op: bool = False) -> Any:
        self._route("broadcast", ("tensor", tensor))
        _rules.check("broadcast", (tensor,), {"root": root}, 0, 1)
        return self._done(async_op)

    def reduce(self, tensor: Any, root: int = 0, op: str = "sum", async_op: bool = False) -> Any:
        self._route("reduce", ("tensor", tensor))
        _rules.check("reduce", (tensor,), {"root": root, "op": _rules.redop(op)}, 0, 1)
        return self._done(async_op)

    def barrier(self, async_op: bool = False) -> Any:
        return self._done(async_op)

    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Any:
        _alltoall.check_single(output, input, output_split_sizes, input_split_sizes, 0, 1)
        local_copy(output, input)
        return self._done(async_op)

    all_to_all = Group.all_to_all
    _route = staticmethod(Group._route)  # the same device rules and messages

    def _no_peer(self, op: str) -> None:
        raise ValueError(f"{op}: group '{self.name}' has one rank, so there is no peer to {op} with")

    def send(self, tensor: Any, dst: int, async_op: bool = False, tag: int = 0) -> Any:
        check_tag(tag, "send")
        self._no_peer("send")

    def recv(self, tensor: Any, src: int, async_op: bool = False, tag: int = 0) -> Any:
        check_tag(tag, "recv")
        self._no_peer("recv")

    def batch(self, ops: Sequence[Any], async_op: bool = False) -> Any:
        """The collectives of the batch in list order (a send or recv has no peer here)."""
        items = batch_items(ops, self)
        if not items:
            raise ValueError("batch: argument 'ops' is empty; expected at least one op")
        for name, *_ in items:
            if name in ("send", "recv"):
                self._no_peer(name)
        _C.check_calls(items, 0, 1)
        for name, *args in items:
            if name in ("all_gather", "reduce_scatter", "copy"):
                local_copy(args[0], args[1])
        return self._done(async_op)

    def abort(self) -> None:
        """Nothing to tell: no other rank waits on a group of one."""

    def destroy(self) -> None:
        pass


__all__ = ["LocalGroup"]
