"""Moving tensors between the devices of a Pipe's partitions.

CPU to CPU is free (the same tensor). A copy that involves a CUDA device runs on a copy stream of
each CUDA device involved, ordered by events after the producer's compute stream and before the
consumer's; the destination is allocated on the consumer's compute stream, so the caching
allocator never hands its memory to another stream early. The source must outlive the copy:
the copy returns a Hold that keeps it and, when released, makes the source's compute stream
wait for the copy before the source may be freed (no ``record_stream``, no host sync; only a
copy into host memory waits on the host, since the CPU consumer needs the data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


@dataclass
class Hold:
    """A source tensor kept alive until `stream` has been ordered after `event`."""

    tensor: Tensor
    stream: "torch.cuda.Stream"
    event: "torch.cuda.Event"

    def release(self) -> None:
        self.stream.wait_event(self.event)


class Streams:
    """The compute stream of each CUDA device (the caller's current stream at forward time) and
    one copy stream per CUDA device."""

    def __init__(self) -> None:
        self.compute: Dict[torch.device, "torch.cuda.Stream"] = {}
        self.copy: Dict[torch.device, "torch.cuda.Stream"] = {}

    def capture(self, devices: Sequence[torch.device]) -> None:
        self.compute = {d: torch.cuda.current_stream(d) for d in set(devices) if d.type == "cuda"}
        for d in self.compute:
            if d not in self.copy:
                self.copy[d] = torch.cuda.Stream(d)

    def compute_stream(self, device: torch.device) -> Optional["torch.cuda.Stream"]:
        return self.compute.get(device)


def move(values: Sequence[Optional[Tensor]], dst: torch.device, streams: Streams, holds: List[Hold]) -> Tuple:
    """`values` on device `dst` (None stays None); appends the sources to keep to `holds`."""
    out = []
    for x in values:
        if x is None or x.device == dst or (x.device.type == "cpu" and dst.type == "cpu"):
            out.append(x)
            continue
        out.append(_copy(x, dst, streams, holds))
    return tuple(out)


def _copy(x: Tensor, dst: torch.device, streams: Streams, holds: List[Hold]) -> Tensor:
    src = x.device
    src_compute = streams.compute_stream(src)
    dst_compute = streams.compute_stream(dst)
    y = torch.empty_like(x, device=dst)  # on dst's compute stream (the calling task's current stream)
    src_copy = streams.copy.get(src)
    dst_copy = streams.copy.get(dst)
    for copy_stream in (src_copy, dst_copy):
        if copy_stream is None:
            continue
        if src_compute is not None:
            copy_stream.wait_stream(src_compute)  # the producer has written x
        if dst_compute is not None:
            copy_stream.wait_stream(dst_compute)  # y's memory is no longer read by earlier work
    with _streams(src_copy, dst_copy):
        y.copy_(x, non_blocking=True)
    done = torch.cuda.Event()
    done.record(dst_copy if dst_copy is not None else src_copy)
    if dst_compute is not None:
        dst_compute.wait_event(done)
    else:
        done.synchronize()  # a CPU consumer reads y right away
    if src_compute is not None:
        holds.append(Hold(x, src_compute, done))
    return y


class _streams:
    """Make the given CUDA streams current on their devices (None: leave as is)."""

    def __init__(self, *streams: Optional["torch.cuda.Stream"]) -> None:
        self.contexts = [torch.cuda.stream(s) for s in streams if s is not None]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)
