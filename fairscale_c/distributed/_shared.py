"""Shared tensors: CPU tensors in memory that every rank of a group maps, so that collectives whose
buffers all lie in one of them move each byte with one plain copy (see docs/collectives.md,
"Shared tensors")."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, List, Sequence

import torch

from .. import _C
from ._group import Group
from ._local import LocalGroup

_SLICE_ALIGN = 2 << 20  # each rank's slice starts on a 2 MiB boundary (huge-page and cache-line friendly)
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)  # what the engine's collectives take


def _parse_size(size: Sequence[Any]) -> List[int]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    dims = []
    for i, d in enumerate(size):
        if isinstance(d, bool) or not isinstance(d, int) and not hasattr(d, "__index__"):
            raise TypeError(f"shared_empty: size[{i}] is {d!r}; expected non-negative ints")
        d = int(d.__index__())
        if d < 0:
            raise ValueError(f"shared_empty: size[{i}] is {d}; expected non-negative ints")
        dims.append(d)
    return dims


def shared_empty(*size: Any, dtype: torch.dtype = torch.float32, group: Any) -> torch.Tensor:
    """A zero-filled, contiguous CPU tensor of ``size`` and ``dtype`` whose memory every rank of
    ``group`` maps. Collective: every rank calls it with the same size and dtype. See
    fairscale_c.distributed.shared_empty."""
    dims = _parse_size(size)
    if dtype not in _DTYPES:
        raise TypeError(f"shared_empty: dtype is {dtype!r}; expected one of {', '.join(map(str, _DTYPES))}")
    numel = 1
    for d in dims:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not isinstance(group, (Group, LocalGroup)):
        raise TypeError(
            f"shared_empty: group is {type(group).__name__}; expected a fairscale_c.distributed Group "
            "(init_group, group_for) or None for the default group"
        )
    if isinstance(group, LocalGroup) or group.size == 1 or group._shm is None:
        # one rank, or ranks that do not share a host: nothing to share
        return torch.zeros(dims, dtype=dtype)
    stride = max(_SLICE_ALIGN, -(-nbytes // _SLICE_ALIGN) * _SLICE_ALIGN)
    total = stride * group.size
    fd, mapping, why = -1, None, None
    if group.rank == 0:
        try:
            fd, ident, mapping = _C._shared_create(total)
        except (OSError, MemoryError) as exc:  # reported to the peers, who fall back with rank 0
            why, ident = f"rank 0 could not create it ({exc})", 0
    request = {"pid": os.getpid(), "size": dims, "dtype": str(dtype)}
    if group.rank == 0:
        request.update(fd=fd, id=ident, why=why)
    try:
        reqs = [json.loads(b) for b in group._exchange.all_gather(json.dumps(request).encode())]
        for r, q in enumerate(reqs):
            if (q["size"], q["dtype"]) != (dims, str(dtype)):
                raise ValueError(
                    f"shared_empty on group '{group.name}': every rank must ask for the same size and dtype; "
                    f"rank {group.rank} asked for {tuple(dims)} {dtype}, rank {r} for {tuple(q['size'])} {q['dtype']}"
                )
        head = reqs[0]
        if group.rank != 0 and head["why"] is None:
            try:
                mapping = _C._shared_open(head["pid"], head["fd"], total, head["id"])
            except (OSError, MemoryError) as exc:
                why = f"rank {group.rank} could not map it ({exc})"
        reports = [json.loads(b) for b in group._exchange.all_gather(json.dumps({"why": why}).encode())]
    finally:
        if fd >= 0:
            os.close(fd)  # every peer that could map the allocation has (the mappings keep it)
    # The store lives in one rank's process: no rank returns, and perhaps exits with the store,
    # before every rank has read the reports.
    group._shm.barrier()
    whys = [r["why"] for r in reports if r["why"] is not None]
    if whys:
        del mapping  # unmapped
        warnings.warn(
            f"shared_empty on group '{group.name}': shared memory refused ({'; '.join(whys)}); "
            "returning a private tensor (collectives on it take the slower paths)",
            RuntimeWarning,
            stacklevel=3,
        )
        return torch.zeros(dims, dtype=dtype)
    buf = _C._shared_slice(mapping, group.rank * stride, dims, str(dtype))
    return torch.from_dlpack(buf)


def is_shared(tensor: Any) -> bool:
    """True when ``tensor``'s memory lies in a shared tensor allocation of this process."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return False
    return _C._shared_contains(tensor.data_ptr(), max(1, tensor.numel()) * tensor.element_size())
