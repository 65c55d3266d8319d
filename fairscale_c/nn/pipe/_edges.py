"""The CUDA layout of the multi-process schedules' messages: one engine group per direction and
edge class, so that on every NCCL communicator a rank only sends or only receives."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch


def _second_group(group: Any, role: str = "pipeline_grad") -> Any:
    """Another engine group over the same ranks (a collective over ``group``); for a torch process
    group, one per ``role``, shared by the schedules of the process."""
    from ... import distributed as fdist

    pg = getattr(group, "process_group", None)
    if pg is not None:
        return fdist.group_for(pg, role)
    return group.new_group(list(range(group.size)))


def _edge_class(kind: str, src: int, p: int) -> int:
    """The class of the pipeline edge from group rank ``src``: activations ("F") go from rank ``r``
    to ``r + 1``, gradients ("B") to ``r - 1`` (mod ``p``). Edges of one class never share a rank
    as sender of one and receiver of another: the class is the sender's parity, and with an odd
    ``p`` the edge across the wrap (``p - 1`` to 0 for activations, 0 to ``p - 1`` for gradients),
    whose two ends have the same parity, has a class of its own (2)."""
    wrap = src == (p - 1 if kind == "F" else 0)
    return 2 if p % 2 and wrap else src % 2


def _edge_groups(group: Any, device: torch.device) -> Dict[Tuple[str, int], Any]:
    """One engine group per (kind, edge class), for a CUDA ``device`` each with its NCCL
    communicator created and this rank's pairs on it connected (a collective over ``group``: every
    rank builds all of them, in the same order). The schedules take this layout on CUDA only; the
    tests also run it on the CPU, where the engine needs no set-up."""
    p, rank = group.size, group.rank
    edges = [("F", rank, (rank + 1) % p), ("F", (rank - 1) % p, rank)]  # this rank's, both kinds
    edges += [("B", rank, (rank - 1) % p), ("B", (rank + 1) % p, rank)]
    out = {}
    for kind in ("F", "B"):
        for cls in range(3 if p % 2 else 2):
            g = out[(kind, cls)] = _second_group(group, f"pipeline_{kind}{cls}")
            if device.type != "cuda":
                continue
            g.init_nccl(device)  # now, while every rank is here, not at a first message
            # connect each pair symmetrically: a one-sided first message aborted NCCL 2.32 (stage.py)
            peers = {
                dst if src == rank else src for k, src, dst in edges if k == kind and _edge_class(k, src, p) == cls
            }
            g.connect(sorted(peers), device)
    return out
