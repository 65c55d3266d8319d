"""OSS's state-dict plumbing: merging per-rank shards, copying state, and packing one rank's shard
into a single byte buffer, so that consolidation moves a shard with one collective."""

from __future__ import annotations

import math
import pickle
from typing import Any, Callable, Dict, List, Tuple

import torch

ALIGN = 64  # bytes: alignment of each tensor inside a packed state shard
# State entries of torch's optimizers that have the parameter's shape (checked when loading,
# sliced when stepping in blocks).
PER_ELEMENT_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum")


def map_tensors(value: Any, fn: Callable[[Any], Any], leaf: Callable[[Any], bool] = torch.is_tensor) -> Any:
    """``value`` with every leaf (by default every tensor) inside dicts, lists and tuples replaced
    by ``fn(leaf)``; anything else is kept as it is."""
    if leaf(value):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(x, fn, leaf) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(x, fn, leaf) for x in value)
    return value


def copy_state(value: Any) -> Any:
    return map_tensors(value, lambda t: t.detach().clone())


def to_cpu(state: Dict[int, Any]) -> Dict[int, Any]:
    return {k: map_tensors(v, lambda t: t.detach().to("cpu", copy=True)) for k, v in state.items()}


def merge_shards(shards: Any) -> Dict[str, Any]:
    """One state dict from every rank's local_state_dict(), whatever order they come in."""
    what = "OSS.load_state_dict: argument 'state_dict'"
    if not shards or not all(isinstance(s, dict) and "rank" in s and "world_size" in s for s in shards):
        raise ValueError(f"{what}: a list must hold local_state_dict() shards (with 'rank' and 'world_size')")
    sizes = {s["world_size"] for s in shards}
    ranks = sorted(s["rank"] for s in shards)
    if len(sizes) != 1 or ranks != list(range(sizes.pop())):
        raise ValueError(
            f"{what}: the shards are not one complete set: ranks {ranks} of world sizes "
            f"{sorted({s['world_size'] for s in shards})} (expected each rank 0..N-1 of one world size N once)"
        )
    state: Dict[Any, Any] = {}
    for s in sorted(shards, key=lambda s: s["rank"]):
        twice = set(state) & set(s["state"])
        if twice:
            raise ValueError(f"{what}: parameters {sorted(twice)} have state in more than one shard")
        state.update(s["state"])
    first = min(shards, key=lambda s: s["rank"])
    merged = {k: v for k, v in first.items() if k not in ("rank", "world_size")}  # extras as rank 0 saved them
    merged["state"] = dict(sorted(state.items()))
    return merged


class TensorRef:
    """Where a tensor of a packed shard lives: byte offset, dtype, shape."""

    __slots__ = ("offset", "dtype", "shape")

    def __init__(self, offset: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> None:
        self.offset, self.dtype, self.shape = offset, dtype, shape

    def __getstate__(self) -> Any:
        return (self.offset, self.dtype, self.shape)

    def __setstate__(self, state: Any) -> None:
        self.offset, self.dtype, self.shape = state


def pack(state: Dict[int, Any], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """One shard as a uint8 buffer on ``device``: every tensor's bytes (64-byte aligned), then the
    pickled structure with tensors replaced by their place. Returns (buffer, [data bytes, layout bytes])."""
    tensors: List[torch.Tensor] = []
    offset = 0

    def ref(t: torch.Tensor) -> TensorRef:
        nonlocal offset
        r = TensorRef(offset, t.dtype, tuple(t.shape))
        tensors.append(t)
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return r

    layout = pickle.dumps({k: map_tensors(v, ref) for k, v in state.items()})
    data_bytes = offset
    buf = torch.empty(data_bytes + len(layout), dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[offset : offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += -(-n // ALIGN) * ALIGN
    buf[data_bytes:].copy_(torch.frombuffer(bytearray(layout), dtype=torch.uint8))
    return buf, torch.tensor([data_bytes, len(layout)], dtype=torch.int64, device=device)


def unpack(buf: torch.Tensor, data_bytes: int) -> Dict[int, Any]:
    """The shard of :func:`pack`, on CPU. Every tensor gets a storage of its own: views of the
    received buffer could not be saved, since torch.save refuses tensors of different dtypes that
    view one storage, and records a storage's size in elements of the saved tensor's dtype (a
    buffer whose byte size is not a multiple of it gives a file torch.load rejects)."""
    host = buf if buf.device.type == "cpu" else buf.cpu()
    layout = pickle.loads(bytes(host[data_bytes:].tolist()))  # a few hundred bytes; no numpy needed

    def build(r: TensorRef) -> torch.Tensor:
        n = math.prod(r.shape) * r.dtype.itemsize
        return host[r.offset : r.offset + n].view(r.dtype).view(r.shape).clone()

    return {k: map_tensors(v, build, leaf=lambda x: isinstance(x, TensorRef)) for k, v in layout.items()}
