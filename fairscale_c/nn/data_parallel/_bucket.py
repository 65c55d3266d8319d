"""Reduce-scatter bucketing (FairScale's bucket_cap_mb) and the reduce-scatters in flight.

Flat gradients smaller than the cap (and, on CPU, than 1 MiB) are packed together (in C: a host
copy on CPU, device copies enqueued on the compute stream on CUDA) and reduced with one
collective; larger ones go out on their own at once. A reduce-scatter's input (the full gradient,
or the packed bucket) must stay alive until the collective has read it, so at most
``_MAX_IN_FLIGHT`` of them are: older ones are retired during backward (waited for, their input
released), not at its end, which keeps one full gradient per layer from piling up until the last
layer is done. The reduced shards reach ``.grad`` at the end of backward, as before: handing them
over mid-backward would make offloaded gradients (``move_grads_to_cpu`` on CUDA) block the host on
a device-to-host copy once per layer."""

from collections import deque
from typing import Any, Deque, Dict, List, NamedTuple

import torch

from fairscale_c import _C


# On the CPU engine a gradient of 1 MiB or more is reduce-scattered on its own even below the cap:
# packing it costs more (a copy) than the per-op overhead a bucket saves, and keeps no packed copy
# of it in memory (measurements: docs/benchmarks.md, "Why these settings").
_ALONE_BYTES = 1 << 20

# Reduce-scatters whose input may still be alive: one being sent while the next is queued behind
# it (FSDP2 keeps one). More only holds more full gradients; the engine runs them in order anyway.
_MAX_IN_FLIGHT = 2


class PendingReduce(NamedTuple):
    """One flat gradient's part of a reduce-scatter in flight."""

    out: torch.Tensor  # its shard of the reduced gradient: a view of the collective's output
    input: torch.Tensor  # the collective's input (the full gradient or the packed bucket), alive until retired
    averaged: bool  # reduced with "avg"; a sum is divided by the gradient factors in `drain`


class _Member(NamedTuple):
    """A flat parameter (its instance and handle) whose gradient one reduce-scatter reduces. A
    flat parameter may have several in one backward: a reentrant checkpoint inside its instance
    hands over the gradient of the recomputed part on its own."""

    fsdp: Any
    handle: Any
    pending: PendingReduce


class _BucketKey(NamedTuple):
    """What the gradients sharing a bucket have in common."""

    group: int  # id() of the reduce-scatter group
    device: torch.device
    dtype: torch.dtype
    op: str


class _Queued(NamedTuple):
    """A flat gradient waiting in a bucket."""

    fsdp: Any
    handle: Any
    grad: torch.Tensor


class _InFlight(NamedTuple):
    """An issued reduce-scatter: its work and the members whose ``pending`` it fills."""

    work: Any
    members: List[_Member]


class _Reduced(NamedTuple):
    """A retired reduce-scatter's shard for one flat parameter, handed to ``.grad`` in `drain`."""

    fsdp: Any
    handle: Any
    out: torch.Tensor
    averaged: bool


class ReduceScatterBucket:
    """One per root instance. Gradients of the same process group, device, dtype and reduction
    share a bucket; a bucket is sent when it reaches the cap, and whatever is left at the end of
    backward. Every rank adds the same gradients in the same order, so every rank sends the same
    ops."""

    def __init__(self, cap_mb: float):
        self.cap_bytes = int(cap_mb * 2**20)
        self.buckets: Dict[_BucketKey, List[_Queued]] = {}
        self.in_flight: Deque[_InFlight] = deque()  # in issue order
        self.reduced: List[_Reduced] = []  # retired, until `drain`

    def add(self, fsdp, h, grad: torch.Tensor, average: bool) -> None:
        """Start (or queue) the reduce-scatter of `grad`; its shard reaches the parameter's
        ``.grad`` in `drain`."""
        op = "avg" if average else "sum"
        nbytes = grad.numel() * grad.element_size()
        if fsdp.comm_rs.size == 1 or nbytes >= self.cap_bytes or (not grad.is_cuda and nbytes >= _ALONE_BYTES):
            self._send_alone(fsdp, h, grad, op, average)
        else:
            key = _BucketKey(id(fsdp.comm_rs), grad.device, grad.dtype, op)
            bucket = self.buckets.setdefault(key, [])
            bucket.append(_Queued(fsdp, h, grad))
            if sum(q.grad.numel() * q.grad.element_size() for q in bucket) >= self.cap_bytes:
                self._send(key)
        self._retire(_MAX_IN_FLIGHT)

    def drain(self) -> None:
        """End of backward: send every partly filled bucket, retire every reduce-scatter, divide
        the shards of those that summed by the post-divide factor, and hand each shard to its
        parameter's ``.grad``."""
        for key in list(self.buckets):
            self._send(key)
        self._retire(0)
        for r in self.reduced:
            if not r.averaged and r.fsdp.gradient_postdivide_factor > 1:
                r.out.div_(r.fsdp.gradient_postdivide_factor)
            r.fsdp._accumulate_grad(r.handle, r.out)
        self.reduced.clear()

    def abandon(self) -> None:
        """After a backward that raised: forget the queued gradients, wait for the reduce-scatters
        in flight (their inputs must outlive them) and drop every result."""
        self.buckets.clear()
        self.reduced.clear()
        in_flight, self.in_flight = list(self.in_flight), deque()
        failed = None
        for issued in in_flight:
            try:
                issued.work.wait()
            except Exception as e:  # the group failed: still wait for the others
                failed = failed or e
        if failed is not None:
            raise failed

    def _retire(self, keep: int) -> None:
        """Retire finished reduce-scatters, and the oldest ones until at most `keep` remain: wait
        (on CUDA the compute stream waits; the host does not) and release the input."""
        while self.in_flight and (len(self.in_flight) > keep or self.in_flight[0].work.is_completed()):
            issued = self.in_flight.popleft()
            issued.work.wait()
            for m in issued.members:
                self.reduced.append(_Reduced(m.fsdp, m.handle, m.pending.out, m.pending.averaged))

    def _send_alone(self, fsdp, h, grad: torch.Tensor, op: str, average: bool) -> None:
        # On CUDA `out` is allocated on the compute stream, like `grad`, and the collective runs on
        # the group's side stream; the member's pending keeps both alive until the work is retired (the compute
        # stream waits for it), so their memory is reused only after it (events, no record_stream).
        out = torch.empty(h.layout.shard_numel, dtype=grad.dtype, device=grad.device)
        work = fsdp.comm_rs.reduce_scatter(out, grad, op=op, async_op=True)
        self.in_flight.append(_InFlight(work, [_Member(fsdp, h, PendingReduce(out, grad, average))]))

    def _send(self, key: _BucketKey) -> None:
        entries = self.buckets.pop(key)
        fsdp = entries[0].fsdp
        world = fsdp.world_size
        grads = [q.grad for q in entries]
        packed = torch.empty(sum(g.numel() for g in grads), dtype=key.dtype, device=key.device)
        out = torch.empty(packed.numel() // world, dtype=key.dtype, device=key.device)
        if key.device.type == "cuda":
            # Packed on the compute stream (as FSDP2 copies in), so the gradients can be freed as
            # soon as this returns; `packed` and `out` stay alive in the members until retired.
            _C.pack_blocks(packed, grads, world, torch.cuda.current_stream(key.device).cuda_stream)
        else:
            _C.pack_blocks(packed, grads, world)
        work = fsdp.comm_rs.reduce_scatter(out, packed, op=key.op, async_op=True)
        members, offset = [], 0
        for q in entries:
            n = q.grad.numel() // world
            members.append(_Member(q.fsdp, q.handle, PendingReduce(out[offset : offset + n], packed, key.op == "avg")))
            offset += n
        self.in_flight.append(_InFlight(work, members))
