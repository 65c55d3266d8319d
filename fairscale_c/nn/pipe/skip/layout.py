"""Which partition stashes and which pops each skip tensor of a partitioned Sequential."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from torch import nn

from .namespace import Namespace

Key = Tuple[Namespace, str]


class SkipLayout:
    """Routes of the skip tensors: (namespace, name) -> (stashing partition, popping partition)."""

    def __init__(self, num_partitions: int, routes: Dict[Key, Tuple[int, int]]) -> None:
        self.routes = routes
        self.num_partitions = num_partitions

    def crosses(self, ns: Namespace, name: str) -> bool:
        """Whether the stash and the pop of this skip tensor are in different partitions."""
        src, dst = self.routes.get((ns, name), (-1, -1))
        return src != dst

    def __bool__(self) -> bool:
        return any(src != dst for src, dst in self.routes.values())


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    from .skippable import Skippable

    stashed_at: Dict[Key, int] = {}
    routes: Dict[Key, Tuple[int, int]] = {}
    for j, partition in enumerate(partitions):
        for layer in partition:
            if not isinstance(layer, Skippable):
                continue
            for key in layer.stashable():
                stashed_at[key] = j
            for key in layer.poppable():
                routes[key] = (stashed_at.pop(key), j)
    return SkipLayout(len(partitions), routes)


__all__: List[str] = []
