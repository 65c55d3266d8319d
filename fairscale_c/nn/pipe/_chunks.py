"""Chunk specs of the multi-process schedules: how ``PipelineSchedule.step`` splits a batch's
inputs into micro-batches and merges the last stage's outputs."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch


class TensorChunkSpec:
    """How :meth:`PipelineSchedule.step` splits one input tensor into micro-batches (along
    ``split_dim``, ``torch.tensor_split``-style: the first ``size % n_microbatches`` micro-batches
    one larger), or merges the last stage's outputs back (concatenated along ``split_dim``). The
    same as ``torch.distributed.pipelining.TensorChunkSpec``, which the schedules also accept."""

    def __init__(self, split_dim: int) -> None:
        if not isinstance(split_dim, int) or isinstance(split_dim, bool):
            raise TypeError(f"TensorChunkSpec: split_dim must be an int, got {type(split_dim).__name__}")
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorChunkSpec) and other.split_dim == self.split_dim

    def __hash__(self) -> int:
        return hash(("TensorChunkSpec", self.split_dim))

    @staticmethod
    def from_tuple(chunk_dims: Sequence[int]) -> Tuple["TensorChunkSpec", ...]:
        """One spec per positional input: ``from_tuple((0, 1))``."""
        return tuple(TensorChunkSpec(d) for d in chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: Dict[str, int]) -> Dict[str, "TensorChunkSpec"]:
        """One spec per keyword input: ``from_dict({"ids": 0, "mask": 1})``."""
        return {k: TensorChunkSpec(d) for k, d in chunk_dims.items()}


def _spec_dim(spec: Any, what: str, replicate_ok: bool = True) -> Optional[int]:
    """The split dimension of one chunk spec; None: given whole to every micro-batch."""
    if spec is None and replicate_ok:
        return None
    kind = type(spec).__name__
    if kind == "_Replicate" and replicate_ok:  # torch.distributed.pipelining's private "replicate"
        return None
    if isinstance(spec, TensorChunkSpec) or (
        kind == "TensorChunkSpec" and isinstance(getattr(spec, "split_dim", None), int)
    ):
        return int(spec.split_dim)
    allowed = "a TensorChunkSpec" + (" or None (the whole value to every micro-batch)" if replicate_ok else "")
    raise TypeError(f"{what} must be {allowed}, got {kind}")


def _batch_key(args: tuple, kwargs: Optional[Dict[str, Any]]) -> Any:
    """What decides the micro-batches' shapes (the split is a function of it and the specs)."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in args) + tuple(
        (k, tuple(v.shape), v.dtype) for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)
    )


def _norm_dim(dim: int, ndim: int) -> Optional[int]:
    return dim + ndim if -ndim <= dim < 0 else dim if 0 <= dim < ndim else None
