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
    """The route of every skip tensor whose stash and pop are both somewhere in the partitions:
    in their layers, or nested in a layer's sub-modules (FairScale looks at the layers alone, so
    its pairs nested in sub-modules meet across partitions only when nothing is recomputed; here
    they travel between partitions, gradients included, like any other)."""
    from .skippable import Skippable

    stashed_at: Dict[Key, int] = {}
    popped_at: Dict[Key, int] = {}
    for j, partition in enumerate(partitions):
        for module in partition.modules():
            if not isinstance(module, Skippable):
                continue
            for key in module.stashable():
                stashed_at.setdefault(key, j)
            for key in module.poppable():
                popped_at.setdefault(key, j)
    routes = {key: (stashed_at[key], j) for key, j in popped_at.items() if key in stashed_at}
    return SkipLayout(len(partitions), routes)


__all__: List[str] = []
