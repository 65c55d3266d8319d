"""NCCL backend of the collective engine: one communicator per group, for CUDA tensors.

The C core (csrc/comm/nccl.c) loads libnccl at run time, preferring the copy torch already loaded,
and drives a blocking communicator (FAIRSCALE_C_NCCL_BLOCKING=0: a non-blocking one) whose
calls run on a thread of its own under the timeout and whose errors are polled, so a dead peer
surfaces as :class:`fairscale_c.DistributedError` instead of a hang. Collectives are enqueued on a CUDA
stream and return without waiting; :meth:`NcclBackend.wait` and :meth:`NcclBackend.barrier`
block (with the GIL released) until the stream has caught up.

Arguments are checked in C before anything is enqueued: a tensor on the wrong device, of an
unsupported dtype, non-contiguous, or of the wrong size raises ``ValueError`` (``TypeError``
for a non-tensor) naming the argument.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence, Union

import torch

from .. import _C
from .._C import DistributedError

__all__ = ["NcclBackend"]

StreamLike = Union[None, int, "torch.cuda.Stream"]

UNIQUE_ID_BYTES = 128


def _nccl_candidates() -> List[str]:
    """libnccl files of the nvidia-nccl wheel torch depends on, when installed."""
    try:
        import nvidia.nccl  # type: ignore[import-not-found]
    except ImportError:
        return []
    paths = (os.path.join(base, "lib", "libnccl.so.2") for base in getattr(nvidia.nccl, "__path__", []))
    return [p for p in paths if os.path.isfile(p)]


class NcclBackend:
    """One rank's NCCL communicator for a group of ``size`` ranks.

    ``exchange(data)`` must broadcast bytes from group rank 0 to every rank and return them
    (rank 0 passes the bytes, the others ``None``); it carries the 128-byte NCCL unique id.
    Construction blocks until every rank has joined or ``timeout`` seconds (default
    ``FAIRSCALE_C_TIMEOUT``) have passed. ``device`` defaults to torch's current CUDA device.
    A watchdog thread aborts the communicator on an NCCL error, or when an enqueued operation is
    still unfinished ``timeout`` seconds later, so a dead peer cannot leave the device (and a host
    synchronisation) waiting forever; the next call then raises ``DistributedError``.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        exchange: Callable[[Optional[bytes]], bytes],
        device: Union[None, int, torch.device] = None,
        timeout: Optional[float] = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("NcclBackend needs CUDA, and torch.cuda.is_available() is False")
        if device is None:
            index = torch.cuda.current_device()
        else:
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"argument 'device': expected a CUDA device, got {dev}")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._timeout = float(timeout) if timeout is not None else 0.0
        if rank == 0:
            # Rank 0 always answers the exchange, with b"" on failure, so that the other ranks
            # fail fast instead of waiting for an id that will never come.
            try:
                _C.nccl_load(_nccl_candidates())
                uid = _C.nccl_unique_id()
            except Exception:
                exchange(b"")
                raise
            exchange(uid)
        else:
            uid = exchange(None)
            if len(uid) != UNIQUE_ID_BYTES:
                raise DistributedError(
                    f"NCCL set-up on rank {rank}: rank 0 could not create an NCCL unique id (see its error)"
                )
            _C.nccl_load(_nccl_candidates())
        self._comm = _C.NcclComm(bytes(uid), rank, size, index, self._timeout)
        self._barrier_buf = torch.zeros(1, dtype=torch.float32, device=self.device)

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    @property
    def version(self) -> int:
        """NCCL_VERSION_CODE of the loaded libnccl, e.g. 22703 for 2.27.3."""
        return self._comm.version

    def _stream(self, stream: StreamLike) -> int:
        if stream is None:
            return torch.cuda.current_stream(self.device).cuda_stream
        if isinstance(stream, int):
            return stream
        if isinstance(stream, torch.cuda.Stream):
            return stream.cuda_stream
        raise TypeError(f"argument 'stream': expected None, an int or a torch.cuda.Stream, got {type(stream).__name__}")

    # DLPack cannot export tensors that require grad; collectives act on the data only.
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: StreamLike = None) -> None:
        """output (size * input.numel() elements) = every rank's input, in rank order."""
        self._comm.all_gather(output.detach(), input.detach(), self._stream(stream))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str, stream: StreamLike = None) -> None:
        """output = this rank's block of the reduction (op: 'sum'|'avg'|'max'|'min') of every input."""
        self._comm.reduce_scatter(output.detach(), input.detach(), op, self._stream(stream))

    def all_reduce(self, tensor: torch.Tensor, op: str, stream: StreamLike = None) -> None:
        """tensor = the reduction of every rank's tensor, in place."""
        self._comm.all_reduce(tensor.detach(), op, self._stream(stream))

    def broadcast(self, tensor: torch.Tensor, root: int, stream: StreamLike = None) -> None:
        """tensor = root's tensor on every rank."""
        self._comm.broadcast(tensor.detach(), root, self._stream(stream))

    def reduce(self, tensor: torch.Tensor, op: str, root: int, stream: StreamLike = None) -> None:
        """root's tensor = the reduction of every rank's tensor; others unchanged."""
        self._comm.reduce(tensor.detach(), op, root, self._stream(stream))

    def send(self, tensor: torch.Tensor, peer: int, stream: StreamLike = None, tag: int = 0) -> None:
        """NCCL has no message tags: ``tag`` must be 0 (ValueError otherwise, before anything is enqueued)."""
        self._comm.send(tensor.detach(), peer, self._stream(stream), tag)

    def recv(self, tensor: torch.Tensor, peer: int, stream: StreamLike = None, tag: int = 0) -> None:
        """NCCL has no message tags: ``tag`` must be 0 (ValueError otherwise, before anything is enqueued)."""
        self._comm.recv(tensor.detach(), peer, self._stream(stream), tag)

    def batch(self, ops: Sequence[tuple], stream: StreamLike = None) -> None:
        """Enqueue several operations as one NCCL group: they launch together, and sends and
        receives between the same ranks cannot deadlock on their order. Each op is a tuple
        ``(name, *args)`` with the arguments of the method of that name (without ``stream``):
        ``("all_gather", output, input)``, ``("reduce_scatter", output, input, op)``,
        ``("all_reduce", tensor, op)``, ``("broadcast", tensor, root)``,
        ``("reduce", tensor, op, root)``, ``("send", tensor, peer[, tag])``,
        ``("recv", tensor, peer[, tag])`` (tag 0 only: NCCL has no tags), ``("copy", output, input)``
        (a send to this rank and a recv from it). Every op is checked before
        anything is enqueued (ValueError naming the op's index)."""
        detached = [tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in op) for op in ops]
        self._comm.batch(detached, self._stream(stream))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]],
        input_split_sizes: Optional[Sequence[int]],
        stream: StreamLike = None,
    ) -> None:
        """Input's dim-0 block j goes to rank j, output's block i comes from rank i (split sizes in
        rows; None: equal blocks), as one NCCL group; the own block is a send to this rank."""
        self._comm.all_to_all_single(
            output.detach(), input.detach(), output_split_sizes, input_split_sizes, self._stream(stream)
        )

    def wait(self, stream: StreamLike = None, timeout: Optional[float] = None) -> None:
        """Block until the work on ``stream`` is done; DistributedError (communicator aborted)
        on an NCCL error or after ``timeout`` seconds (default FAIRSCALE_C_TIMEOUT)."""
        self._comm.wait(self._stream(stream), float(timeout) if timeout is not None else self._timeout)

    def barrier(self) -> None:
        """Return once every rank has reached the barrier (a one-element all-reduce, waited on)."""
        stream = self._stream(None)
        self._comm.all_reduce(self._barrier_buf, "sum", stream)
        self._comm.wait(stream, self._timeout)

    def abort(self) -> None:
        """Stop pending work and free the communicator without waiting for other ranks."""
        self._comm.abort()

    def destroy(self, timeout: Optional[float] = None) -> None:
        """Orderly teardown; every rank should call it. Idempotent. After ``timeout`` seconds
        (default FAIRSCALE_C_TIMEOUT) the communicator is aborted and DistributedError raised."""
        self._comm.destroy(float(timeout) if timeout is not None else self._timeout)
