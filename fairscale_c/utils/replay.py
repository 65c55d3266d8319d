"""What a recomputation needs to replay a forward pass as it ran: the random generators' state (the
CPU's, and the CUDA device's) and the autocast state. Pipe's checkpointed tasks, MEVO's backward
and OffloadModel's checkpointed slices recompute under them."""

from __future__ import annotations

import contextlib
from typing import Generator, NamedTuple, Optional, Tuple

import torch

__all__ = ["RNGState", "capture_rng", "restore_rng", "AutocastState", "autocast_state", "autocast"]


class RNGState(NamedTuple):
    cpu: torch.Tensor
    cuda: Optional[torch.Tensor]


def capture_rng(device: torch.device) -> RNGState:
    """The CPU generator's state, and ``device``'s when it is a CUDA device."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return RNGState(torch.get_rng_state(), cuda)


def restore_rng(state: RNGState, device: torch.device) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, device)


AutocastState = Tuple[Tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)


def autocast_state() -> AutocastState:
    """The calling thread's autocast state for the CPU and, where CUDA is available, for CUDA."""
    types = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)


@contextlib.contextmanager
def autocast(state: AutocastState) -> Generator[None, None, None]:
    """Runs the block under ``state``: enabled where it was, and disabled where it was not (so a
    replay inside an autocast region the forward did not run in computes as the forward did)."""
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield
