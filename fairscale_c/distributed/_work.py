"""Work handles that behave the same on both devices, and the copy a one-rank collective is.

CPU ops on the shared-memory engine return ``fairscale_c._C.Work`` (``wait()`` blocks with the GIL
released; ``is_completed()`` polls). CUDA ops return :class:`CudaWork`: the op ran on the group's
side stream, ``wait()`` makes the caller's current stream wait for its completion event (no host
synchronisation) and ``is_completed()`` queries that event.
"""

from __future__ import annotations

import time
from typing import Any, Tuple

import torch

from .. import _C

_CUDA_CASTS = ({torch.float32, torch.float16}, {torch.float32, torch.bfloat16})  # what cuda_cast converts


class CompletedWork:
    """Work of an op that had finished when it returned (a group of one rank, the torch fallback
    for CPU groups across hosts)."""

    __slots__ = ()

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class CudaWork:
    """A collective enqueued on a group's side stream, ordered after the caller's current stream.

    ``wait()`` makes the current stream (of the work's device) wait for the op's completion event:
    the host never blocks. ``wait(timeout)`` also blocks the host until the event has completed,
    raising ``DistributedError`` after ``timeout`` seconds. ``is_completed()`` queries the event.
    The work keeps its tensors alive until a stream has been made to wait for it, so the caching
    allocator cannot hand their memory to other work first (events order reuse; no record_stream).
    """

    __slots__ = ("event", "device", "_keep", "_nccl", "_what")

    def __init__(self, event: "torch.cuda.Event", device: torch.device, keep: Tuple[Any, ...], nccl: Any, what: str):
        self.event, self.device, self._keep, self._nccl, self._what = event, device, keep, nccl, what

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self, timeout: Any = None) -> bool:
        if timeout is not None:
            if hasattr(timeout, "total_seconds"):  # a datetime.timedelta, as torch's Work.wait takes
                timeout = timeout.total_seconds()
            if timeout < 0:
                raise ValueError(f"wait: timeout must be >= 0 or None, got {timeout!r}")
            deadline = time.monotonic() + timeout
            pause = 1e-5
            while not self.event.query():
                if time.monotonic() >= deadline:
                    raise _C.DistributedError(
                        f"Work.wait: {self._what} did not complete within {timeout:g} s (it is still running)"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        torch.cuda.current_stream(self.device).wait_event(self.event)
        self._keep = ()
        return True

    def __del__(self) -> None:
        # Dropped without wait(): order the current stream after it anyway, so that the memory of
        # its tensors is not reused before the collective has read and written it.
        if self._keep:
            try:
                torch.cuda.current_stream(self.device).wait_event(self.event)
            except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone
                pass


def local_copy(output: torch.Tensor, input: torch.Tensor) -> None:
    """What all_gather and reduce_scatter are on a group of one rank: output = input, copied or
    cast without bumping ``output``'s version counter (autograd checks it on saved views). Host
    memory goes through the C core, float32 <-> float16/bfloat16 casts on one GPU through the C
    kernels (on the current stream), anything else through an alias that shares the storage but
    has a version counter of its own."""
    if output.device.type == "cpu" and input.device.type == "cpu":
        _C.copy_(output, input)
        return
    if (
        output.device == input.device
        and output.device.type == "cuda"
        and {output.dtype, input.dtype} in _CUDA_CASTS
        and output.is_contiguous()
        and input.is_contiguous()
        and output.numel() == input.numel()
    ):
        _C.cuda_cast(output.detach(), input.detach(), torch.cuda.current_stream(output.device).cuda_stream)
        return
    alias = torch.empty(0, dtype=output.dtype, device=output.device)
    alias.set_(output.untyped_storage(), output.storage_offset(), output.shape, output.stride())
    with torch.no_grad():
        alias.copy_(input)
