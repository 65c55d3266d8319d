"""Run-time state of FSDP's flat parameters: the full buffer a shard is gathered into (its storage
released between uses), the all-gather in flight, and the parameters an
instance shares with the instance that shards them, and what an instance is doing."""

from enum import Enum, auto
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .flat_param import FlatLayout, ParamSlot


class TrainingState(Enum):
    """What an FSDP instance is doing (FairScale's states)."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
    SUMMON_FULL_PARAMS = auto()


def free_storage(t: torch.Tensor) -> None:
    """Release `t`'s storage; the tensor object (and autograd's references to it) stays."""
    if t.untyped_storage().size() > 0:
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give `t`'s released storage its size back (contents undefined until written)."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


class Gathering(NamedTuple):
    """An all-gather of one flat parameter started ahead of use (``Handle.gathering``)."""

    work: Any  # the collective's Work: wait() before the full buffer is read
    shard: torch.Tensor  # its input (the shard, or its cast in the full buffer), alive until then


class Handle:
    """Run-time state of one flat parameter."""

    def __init__(self, layout: FlatLayout, param: nn.Parameter, compute_dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.param = param  # fp32 shard: what the optimizer sees
        self.full = self.new_full(compute_dtype, device)
        pad = layout.padded_numel - layout.numel
        self.split_sizes = [s.numel for s in layout.slots] + ([pad] if pad else [])
        self.has_full = False
        self.gathered_at = -1  # the shard's optimizer steps (_fsc_steps) at the full buffer's last gather
        self.gathering: Optional[Gathering] = None  # while an all-gather started ahead runs
        self.backing_name = ""  # "flat_param_<i>", or the parameter's name when not flattened
        self.forward_users = 0  # instances using it (owner and sharers) whose forward is running
        self.summoned: Optional[Dict[int, nn.Parameter]] = None  # id(slot) -> full fp32 parameter, while summoned
        self.grad_hooked = False  # the full buffer's gradient hook is registered (FSDP._hook_full)
        # After a backward in no_sync(): the accumulated full gradient shown on param.grad (a view of
        # full.grad), and the gradient shard param.grad held before it
        self.shown: Optional[torch.Tensor] = None
        self.saved_shard: Optional[torch.Tensor] = None
        # The ReleasedParameters its names hold while the full buffer is released, and what they
        # were made for (dtype, device, requires_grad)
        self.released: List[Any] = []
        self.released_key: Optional[Tuple[Any, ...]] = None

    def places(self) -> List[Tuple[nn.Module, str]]:
        """Unflattened: (module, attribute) where the parameter sits, tied names included."""
        slot = self.layout.slots[0]
        return [(slot.module, slot.attr)] + [(s.module, s.attr) for s in self.layout.shared]

    def new_full(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The full (padded) buffer in the compute dtype. A leaf, so autograd accumulates the
        gradient of every view into one flat gradient; its storage is released when resharded.
        It requires grad as the shard does (``FSDP._sync_requires_grad`` follows later changes)."""
        self.grad_hooked = False
        return torch.zeros(self.layout.padded_numel, dtype=dtype, device=device).requires_grad_(
            self.param.requires_grad
        )


class Tie(NamedTuple):
    """A parameter of an instance's module that another instance shards (a weight tied across
    instances, FairScale's "shared param"): the sharing instance gathers it for its own forward
    and backward; the owner reduces its gradient once autograd has summed every use."""

    module: nn.Module
    attr: str
    name: str  # dotted, relative to the sharing instance's module
    owner: Any  # weakref.ref to the owning instance (not a submodule of the sharer)
    handle: Handle  # the owner's flat parameter that holds it
    slot: ParamSlot  # where in that flat parameter

    def full_view(self) -> torch.Tensor:
        s = self.slot
        return self.handle.full[s.offset : s.offset + s.numel].view(s.shape)
