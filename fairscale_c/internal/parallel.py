"""Process-group helpers of fairscale.internal.parallel: the names FSDP takes for its groups
(``ProcessGroupName``, the very class fairscale_c's FSDP checks against), a cache of torch process
groups by name and ranks, and chunking with padding."""

from __future__ import annotations

from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "ProcessGroupName",
    "chunk_and_pad",
    "validate_process_group",
    "enable_pytorch_sync_bn",
    "get_process_group_cached",
]


class ProcessGroupName(str, Enum):
    """FairScale's names for the cached process groups."""

    default = "default"
    reduce_scatter = "reduce_scatter"


def chunk_and_pad(tensor: torch.Tensor, num_chunks: int) -> List[torch.Tensor]:
    """`tensor` flattened into `num_chunks` chunks of one size, the last ones zero-padded (or
    all-zero where torch.chunk gives fewer chunks)."""
    chunks = list(torch.flatten(tensor).chunk(num_chunks))
    pad = chunks[0].numel() - chunks[-1].numel()
    if pad > 0:
        chunks[-1] = F.pad(chunks[-1], [0, pad])
    chunks += [torch.zeros_like(chunks[0]) for _ in range(num_chunks - len(chunks))]
    return chunks


def validate_process_group(device: torch.device, process_group: Any) -> None:
    """On CUDA, check that every rank of `process_group` is on a distinct working device (an
    all-gather of ones); a stand-in group without ``allgather`` is not checked."""
    if not hasattr(process_group, "allgather") or "cuda" not in str(device):
        return
    world = process_group.size()
    out = list(torch.zeros(world, device=device).chunk(world))
    dist.all_gather(out, torch.ones(1, device=device), group=process_group)
    found = torch.cat(out).sum().item()
    if found != float(world):
        raise RuntimeError(
            f"found {found} devices in process group but world_size={world}. Check torch.cuda.set_device is "
            "called properly"
        )


def enable_pytorch_sync_bn(module: torch.nn.Module) -> None:
    """Let torch's SyncBatchNorm layers run outside DDP (older torch needed a GPU count set)."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.SyncBatchNorm) and hasattr(layer, "_specify_ddp_gpu_num"):
            layer._specify_ddp_gpu_num(1)


_groups: Dict[Tuple[ProcessGroupName, Optional[Tuple[int, ...]]], Any] = {}


def get_process_group_cached(
    name: ProcessGroupName = ProcessGroupName.default, ranks: Optional[Sequence[int]] = None
) -> Any:
    """The torch process group for (`name`, `ranks`) (ranks None: all of them), built with
    ``torch.distributed.new_group`` the first time: a collective, so every rank asks for the same
    groups in the same order. The default group over all ranks is built at the first call."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not yet initialized but process group is requested.")
    name = ProcessGroupName(name)
    key_ranks = tuple(sorted(set(ranks))) if ranks is not None else None
    if not _groups:
        _groups[(ProcessGroupName.default, None)] = dist.new_group()
    key = (name, key_ranks)
    if key not in _groups:
        _groups[key] = dist.new_group(ranks=list(key_ranks) if key_ranks is not None else None)
    return _groups[key]
