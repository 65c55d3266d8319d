"""LocalGroup: the group of a single process, with the API of :class:`Group`."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from . import _alltoall
from ._group import Group
from ._p2p import batch_items, check_tag
from ._work import CompletedWork, local_copy


class LocalGroup:
    """The group of a single process (no torch.distributed, or a process group of one rank): every
    collective is a local copy or nothing, completed when it returns."""

    def __init__(self, pg: Any = None, name: str = "local") -> None:
        self.rank, self.size, self.name, self.process_group = 0, 1, name, pg

    def __repr__(self) -> str:
        return f"LocalGroup(name={self.name!r})"

    @staticmethod
    def _done(async_op: bool) -> Any:
        return CompletedWork() if async_op else None

    def _copy(self, op: str, output: Any, input: Any, async_op: bool) -> Any:
        if output.numel() != input.numel():
            big, small = ("output", "input") if op == "all_gather" else ("input", "output")
            n = {"output": output.numel(), "input": input.numel()}
            raise ValueError(
                f"{op}: {big} has {n[big]} elements; expected group size (1) x {small} elements "
                f"({n[small]}) = {n[small]}"
            )
        local_copy(output, input)
        return self._done(async_op)

    def all_gather(self, output: Any, input: Any, async_op: bool = False) -> Any:
        return self._copy("all_gather", output, input, async_op)

    def reduce_scatter(self, output: Any, input: Any, op: str = "sum", async_op: bool = False) -> Any:
        return self._copy("reduce_scatter", output, input, async_op)

    def all_reduce(self, tensor: Any, op: str = "sum", async_op: bool = False) -> Any:
        return self._done(async_op)

    def broadcast(self, tensor: Any, root: int = 0, async_op: bool = False) -> Any:
        if root != 0:
            raise ValueError(f"broadcast: root={root} is not a valid group rank (expected 0 <= root < 1)")
        return self._done(async_op)

    def reduce(self, tensor: Any, root: int = 0, op: str = "sum", async_op: bool = False) -> Any:
        return self.broadcast(tensor, root, async_op)

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
        items = batch_items(ops)
        if not items:
            raise ValueError("batch: argument 'ops' is empty; expected at least one op")
        for name, *args in items:
            if name in ("send", "recv"):
                self._no_peer(name)
            if name == "reduce":  # tuple order: (tensor, op, root)
                self.reduce(args[0], root=args[2], op=args[1])
            elif name in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
                getattr(self, name)(*args)
            elif name == "copy":
                local_copy(*args)
            else:
                raise ValueError(
                    f"batch: '{name}' is not an op; expected all_gather, reduce_scatter, all_reduce, "
                    "broadcast, reduce, send, recv or copy"
                )
        return self._done(async_op)

    def destroy(self) -> None:
        pass


__all__ = ["LocalGroup"]
