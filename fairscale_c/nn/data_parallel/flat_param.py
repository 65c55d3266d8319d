"""Flat-parameter layout: which original parameters live where in one flat, padded, sharded buffer.

FairScale's sharding rule is kept exactly, so shards and metadata interoperate with it: the flat
buffer of ``numel`` elements is cut into ``world_size`` chunks of ``ceil(numel / world_size)``
elements (torch.chunk's rule); rank r holds chunk r, zero-padded at its end to the chunk size.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import nn


@dataclass
class ParamSlot:
    """One original parameter inside a flat buffer."""

    module: nn.Module  # the submodule that owned it
    attr: str  # its attribute name on that submodule
    name: str  # dotted name relative to the FSDP-wrapped module (FairScale's "names")
    shape: torch.Size
    offset: int  # element offset in the flat buffer
    numel: int
    param: Optional[nn.Parameter] = None  # the original parameter; dropped once sharded


@dataclass
class SharedSlot:
    """A parameter tensor reachable under a second name (tied weights)."""

    module: nn.Module
    attr: str
    name: str
    src: ParamSlot


@dataclass
class FlatLayout:
    """Layout of one flat parameter of an FSDP instance."""

    slots: List[ParamSlot]
    world_size: int
    rank: int
    requires_grad: bool
    shared: List[SharedSlot] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def padding_of(self, rank: int) -> int:
        """Zero elements at the end of `rank`'s shard (FairScale's per-rank "padding")."""
        real = max(0, min(self.shard_numel, self.numel - rank * self.shard_numel))
        return self.shard_numel - real

    @property
    def padding(self) -> int:
        return self.padding_of(self.rank)

    def shard_range(self, rank: int) -> Tuple[int, int]:
        """[start, end) of `rank`'s real (unpadded) elements in the flat buffer."""
        start = min(rank * self.shard_numel, self.numel)
        return start, min(start + self.shard_numel, self.numel)

    def metadata(self) -> dict:
        return {
            "names": [s.name for s in self.slots],
            "shapes": [s.shape for s in self.slots],
            "numels": [s.numel for s in self.slots],
            "padding": self.padding,
        }


@dataclass
class ForeignParam:
    """A parameter of the module that another FSDP instance has already sharded (a weight tied
    across instances): where it sits here, and the original tensor (``_fsc_fsdp_sharded`` says
    which instance, flat parameter and slot hold it now)."""

    module: nn.Module
    attr: str
    name: str
    param: nn.Parameter


def collect_params(
    module: nn.Module, is_managed, flatten: bool = True
) -> Tuple[List[FlatLayout], List[Tuple[str, str]], List[ForeignParam]]:
    """Group `module`'s not-yet-managed parameters into flat layouts (one per requires_grad value,
    in order of first appearance; one per parameter when not `flatten`) and find shared (tied)
    parameters.

    Returns the layouts (world size and rank still unset: 1 and 0), the list of
    (source name, destination name) pairs for shared parameters, and the parameters another
    instance has already sharded.
    """
    seen = {}
    groups = {}
    order = []
    shared_pairs = []
    foreign = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()):
            if p is None or is_managed(p):
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if getattr(p, "_fsc_fsdp_sharded", None) is not None:
                if not any(f.module is mod and f.attr == attr for f in foreign):
                    foreign.append(ForeignParam(mod, attr, name, p))
                continue
            if id(p) in seen:
                src, layout = seen[id(p)]
                if (src.module is mod and src.attr == attr) or any(
                    s.module is mod and s.attr == attr for s in layout.shared
                ):
                    continue  # the same module reached again through another path
                layout.shared.append(SharedSlot(mod, attr, name, src))
                shared_pairs.append((src.name, name))
                continue
            key = p.requires_grad if flatten else len(order)
            if key not in groups:
                groups[key] = FlatLayout([], 1, 0, p.requires_grad)
                order.append(key)
            layout = groups[key]
            slot = ParamSlot(mod, attr, name, p.shape, layout.numel, p.numel(), p)
            layout.slots.append(slot)
            seen[id(p)] = (slot, layout)
    return [groups[k] for k in order], shared_pairs, foreign
