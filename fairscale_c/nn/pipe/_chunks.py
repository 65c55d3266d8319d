"""Chunk specs of the multi-process schedules: how ``PipelineSchedule.step`` splits a batch's
inputs into micro-batches and merges the last stage's outputs."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

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


class _Chunking:
    """PipelineSchedule's checks of the chunk specs and its splitting of stage 0's inputs into
    micro-batches. Needs ``_n_microbatches``, ``_first`` (this rank's first stage of the pipeline,
    or None) and ``_kwargs_dims`` on the schedule."""

    _n_microbatches: int
    _first: Any
    _kwargs_dims: Optional[Dict[str, Optional[int]]]

    def _check_args_spec(self, spec: Any) -> Optional[Tuple[Optional[int], ...]]:
        if spec is None:
            return None
        what = f"{type(self).__name__}: args_chunk_spec"
        if not isinstance(spec, (tuple, list)):
            try:
                _spec_dim(spec, what, replicate_ok=False)
                spec = (spec,)  # one spec: one positional input
            except TypeError:
                raise TypeError(
                    f"{what} must be a tuple with one TensorChunkSpec (or None) per positional input, "
                    f"got {type(spec).__name__}"
                ) from None
        if not spec:
            raise ValueError(f"{what} is empty; give one TensorChunkSpec (or None) per positional input")
        return tuple(_spec_dim(s, f"{what}[{k}]") for k, s in enumerate(spec))

    def _check_kwargs_spec(self, spec: Any) -> Optional[Dict[str, Optional[int]]]:
        if spec is None:
            return None
        what = f"{type(self).__name__}: kwargs_chunk_spec"
        if not isinstance(spec, dict):
            raise TypeError(
                f"{what} must be a dict of keyword name -> TensorChunkSpec or None, got {type(spec).__name__}"
            )
        bad = [k for k in spec if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{what}: keys must be keyword names (str), got {bad[0]!r}")
        return {k: _spec_dim(s, f"{what}[{k!r}]") for k, s in spec.items()}

    def _check_merge_spec(self, spec: Any) -> Optional[Tuple[int, ...]]:
        if spec is None:
            return None
        what = f"{type(self).__name__}: output_merge_spec"
        if isinstance(spec, (tuple, list)):
            if not spec:
                raise ValueError(f"{what} is empty; give one TensorChunkSpec per output of the last stage")
            return tuple(_spec_dim(s, f"{what}[{k}]", replicate_ok=False) for k, s in enumerate(spec))  # type: ignore[misc]
        return (_spec_dim(spec, what, replicate_ok=False),)  # type: ignore[return-value]

    def _split_kwargs(self, kwargs: Dict[str, Any], args: tuple) -> List[Dict[str, Any]]:
        """Stage 0's keyword arguments per micro-batch. Without ``kwargs_chunk_spec``: a Tensor with
        a batch dimension (the positional batch's size) is split along it as the batch is;
        anything else (scalars, 0-dim tensors, other objects) goes to every micro-batch unchanged.
        With it, each keyword as its entry says."""
        name, m = type(self).__name__, self._n_microbatches
        device = self._first.device if self._first is not None else None
        dims = self._kwargs_dims
        if dims is not None and set(dims) != set(kwargs):
            missing, extra = sorted(set(kwargs) - set(dims)), sorted(set(dims) - set(kwargs))
            raise ValueError(
                f"{name}.step: kwargs_chunk_spec must have one entry per keyword argument"
                + (f"; no entry for {', '.join(map(repr, missing))}" if missing else "")
                + (f"; {', '.join(map(repr, extra))} not given to step" if extra else "")
            )
        size = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else None
        out: List[Dict[str, Any]] = [{} for _ in range(m)]
        for key, value in kwargs.items():
            if dims is not None:
                dim = dims[key]
                if dim is not None and not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"{name}.step: kwargs_chunk_spec[{key!r}] splits along dim {dim} but keyword argument {key!r} "
                        f"is a {type(value).__name__}; only tensors can be split (None gives it to every micro-batch)"
                    )
            else:
                dim = 0 if isinstance(value, torch.Tensor) and value.dim() > 0 else None
                if dim is not None and value.shape[0] != size:
                    raise ValueError(
                        f"{name}.step: keyword argument {key!r} has {value.shape[0]} rows (dim 0) but the batch "
                        f"has {size}; tensors passed by keyword are split into micro-batches along dim 0 like the "
                        "batch (unless kwargs_chunk_spec says otherwise)"
                    )
            if dim is None:
                for d in out:
                    d[key] = value
                continue
            if device is not None and value.device != device:
                raise ValueError(
                    f"{name}.step: keyword argument {key!r} is on {value.device} but stage 0 computes on "
                    f"{device}; move it there first"
                )
            for i, part in enumerate(self._chunks(value, dim, f"keyword argument {key!r}", "kwargs_chunk_spec")):
                out[i][key] = part
        return out

    def _chunks(self, t: torch.Tensor, dim: int, what: str, spec_name: str) -> Sequence[torch.Tensor]:
        """``t`` split into n_microbatches along ``dim`` (the first ones one larger when uneven)."""
        name, m = type(self).__name__, self._n_microbatches
        d = _norm_dim(dim, t.dim())
        if d is None:
            raise ValueError(
                f"{name}.step: {what} has shape {list(t.shape)}; {spec_name} splits it along dim {dim}, which it "
                "does not have"
            )
        if t.shape[d] < m:
            raise ValueError(
                f"{name}.step: {what} has {t.shape[d]} samples along dim {d}, fewer than n_microbatches={m}"
            )
        return torch.tensor_split(t.contiguous() if d == 0 else t, m, dim=d)

    def _split(
        self, args: tuple, what: str, dims: Optional[Tuple[Optional[int], ...]] = None
    ) -> List[Tuple[torch.Tensor, ...]]:
        name, m = type(self).__name__, self._n_microbatches
        if not args:
            raise ValueError(f"{name}.step: stage 0 needs the batch as positional Tensors, got none")
        if dims is not None and len(dims) != len(args):
            raise ValueError(
                f"{name}.step: args_chunk_spec has {len(dims)} entries but stage 0 was given {len(args)} "
                "positional inputs; give one TensorChunkSpec (or None) per input"
            )
        for k, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{name}.step: {what}[{k}] must be a Tensor, got {type(a).__name__}")
        if dims is None:
            for k, a in enumerate(args):
                if a.dim() == 0:
                    raise ValueError(f"{name}.step: {what}[{k}] is a scalar; expected a batch dimension (dim 0)")
            sizes = sorted({a.shape[0] for a in args})
            if len(sizes) != 1:
                raise ValueError(f"{name}.step: {what} tensors have different batch sizes {sizes} (dim 0)")
        spec_name = "args_chunk_spec" if dims is not None else "the default chunking"
        parts = []
        for k, a in enumerate(args):
            dim = 0 if dims is None else dims[k]
            parts.append([a] * m if dim is None else self._chunks(a, dim, f"{what}[{k}]", spec_name))
        return [tuple(p[i] for p in parts) for i in range(m)]
